//! The layout rules of docs/ARCHITECTURE.md, checked on the source text:
//! - no import circles: no module of src/ imports one that imports it, directly or
//!   through others (a folder's mod.rs counts as a module like any file);
//! - the model is described once: each parameter name and each derived width is
//!   spelled in exactly one source file (the spec);
//! - the trainer, eval and bench never ask which engine they hold.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every .rs file under src/, with its text minus comments and unit tests.
fn sources() -> BTreeMap<PathBuf, String> {
    fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                out.insert(path, code_only(&text));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(&src(), &mut out);
    out
}

/// The text without comments and without the unit-test module at the end.
fn code_only(text: &str) -> String {
    let text = &text[..text.find("#[cfg(test)]").unwrap_or(text.len())];
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn module_of(path: &Path) -> Module {
    let rel = path.strip_prefix(src()).unwrap().with_extension("");
    let mut parts: Module = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] || parts == ["main"] {
        parts.clear();
    }
    parts
}

/// The paths of a use tree: `a::{b, c::{d, e}}` -> a::b, a::c::d, a::c::e.
fn expand_use(tree: &str) -> Vec<String> {
    fn walk(prefix: &str, s: &str, out: &mut Vec<String>) {
        let (mut depth, mut start, mut items) = (0, 0, Vec::new());
        for (i, ch) in s.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&s[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        items.push(&s[start..]);
        for item in items.into_iter().filter(|i| !i.is_empty()) {
            match item.split_once('{') {
                Some((head, rest)) => walk(
                    &format!("{prefix}{head}"),
                    &rest[..rest.rfind('}').unwrap()],
                    out,
                ),
                None => out.push(format!("{prefix}{}", item.split('@').next().unwrap())),
            }
        }
    }
    // `a as b` -> `a@b`, then no white space.
    let tree = tree.replace(" as ", "@");
    let tree: String = tree.chars().filter(|c| !c.is_whitespace()).collect();
    let mut out = Vec::new();
    walk("", &tree, &mut out);
    out
}

/// The paths of the `use` statements of a text (those starting a line), of the
/// `pub use` ones alone when `public`.
fn uses(text: &str, public: bool) -> Vec<String> {
    let mut out = Vec::new();
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let start = offset + line.len() - line.trim_start().len();
        offset += line.len();
        let statement = &text[start..];
        let is_pub = statement.starts_with("pub");
        let Some(i) = statement.find("use ").filter(|&i| {
            let visibility = &statement[..i];
            visibility.is_empty() || visibility.starts_with("pub")
        }) else {
            continue;
        };
        if public && !is_pub || statement[..i].contains(['\n', ';']) {
            continue;
        }
        let tree = &statement[i + 4..];
        out.extend(expand_use(&tree[..tree.find(';').unwrap()]));
    }
    out
}

/// `crate::...` and `super::...` paths written inline.
fn inline_paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for start in ["crate::", "super::"] {
        let mut rest = text;
        while let Some(i) = rest.find(start) {
            let path: String = rest[i..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            out.push(path.trim_end_matches(':').to_string());
            rest = &rest[i + start.len()..];
        }
    }
    out
}

/// A file's text split into its modules: the file's own (inline module bodies cut out)
/// first, then each inline `mod name { .. }` at its path (nested ones too), so that
/// `super::` inside one means the file's module, as it does to the compiler.
fn inline_modules(text: &str, file: &Module) -> Vec<(Module, String)> {
    let mut outer = String::new();
    let mut inner = Vec::new();
    let mut rest = text;
    while let Some((name, open)) = next_inline_mod(rest) {
        let mut depth = 0;
        let close = rest[open..]
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '{' => 1,
                    '}' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map(|(i, _)| open + i)
            // Unclosed where `code_only` cut the unit tests out of the module's end.
            .unwrap_or(rest.len());
        outer.push_str(&rest[..open]);
        let mut path = file.clone();
        path.push(name);
        inner.extend(inline_modules(&rest[open + 1..close], &path));
        rest = &rest[(close + 1).min(rest.len())..];
    }
    outer.push_str(rest);
    let mut out = vec![(file.clone(), outer)];
    out.extend(inner);
    out
}

/// The first line of the form `[pub[(..)]] mod name {`: its name and the byte of its `{`.
fn next_inline_mod(text: &str) -> Option<(String, usize)> {
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let start = offset;
        offset += line.len();
        let mut words = line.split_whitespace();
        let Some(mut word) = words.next() else {
            continue;
        };
        if word.starts_with("pub") {
            word = words.next().unwrap_or("");
        }
        let (Some(name), Some("{")) = (words.next(), words.next()) else {
            continue;
        };
        if word == "mod" && name.chars().all(|c| c.is_alphanumeric() || c == '_') {
            return Some((name.to_string(), start + line.find('{').unwrap()));
        }
    }
    None
}

struct Crate {
    modules: BTreeSet<Module>,
    /// (module, name) re-exported with `pub use` -> the module that defines it.
    reexports: HashMap<(Module, String), Module>,
}

impl Crate {
    /// The module a path from `here` points into, following re-exports; `None` for
    /// external crates.
    fn resolve(&self, path: &str, here: &Module) -> Option<Module> {
        let segs: Vec<&str> = path.split("::").collect();
        let (mut current, rest): (Module, &[&str]) = match segs[0] {
            "crate" => (vec![], &segs[1..]),
            "self" => (here.clone(), &segs[1..]),
            "super" => {
                let ups = segs.iter().take_while(|s| **s == "super").count();
                (
                    here[..here.len().saturating_sub(ups)].to_vec(),
                    &segs[ups..],
                )
            }
            first => {
                let mut child = here.clone();
                child.push(first.to_string());
                if !self.modules.contains(&child) {
                    return None; // another crate
                }
                (here.clone(), &segs[..])
            }
        };
        for s in rest {
            let mut child = current.clone();
            child.push(s.to_string());
            if self.modules.contains(&child) {
                current = child;
            } else if let Some(target) = self.reexports.get(&(current.clone(), s.to_string())) {
                return Some(target.clone());
            } else {
                break;
            }
        }
        Some(current)
    }
}

/// Strongly connected components of more than one module.
fn circles(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    // Kosaraju: order by finish time, then collect on the reversed graph.
    fn finish(
        v: &Module,
        e: &BTreeMap<Module, BTreeSet<Module>>,
        seen: &mut BTreeSet<Module>,
        order: &mut Vec<Module>,
    ) {
        if !seen.insert(v.clone()) {
            return;
        }
        for w in &e[v] {
            finish(w, e, seen, order);
        }
        order.push(v.clone());
    }
    let mut reversed: BTreeMap<Module, BTreeSet<Module>> =
        edges.keys().map(|k| (k.clone(), BTreeSet::new())).collect();
    for (v, ws) in edges {
        for w in ws {
            reversed.get_mut(w).unwrap().insert(v.clone());
        }
    }
    let (mut seen, mut order) = (BTreeSet::new(), Vec::new());
    for v in edges.keys() {
        finish(v, edges, &mut seen, &mut order);
    }
    let (mut assigned, mut out) = (BTreeSet::new(), Vec::new());
    for v in order.iter().rev() {
        let mut comp = Vec::new();
        finish(v, &reversed, &mut assigned, &mut comp);
        if comp.len() > 1 {
            out.push(comp);
        }
    }
    out
}

#[test]
fn no_module_imports_one_that_imports_it() {
    // (file's module, module of the text, text): a file's inline modules resolve paths
    // from where they stand but count as the file, which holds them.
    let pieces: Vec<(Module, Module, String)> = sources()
        .iter()
        .flat_map(|(path, text)| {
            let file = module_of(path);
            inline_modules(text, &file)
                .into_iter()
                .map(move |(here, text)| (file.clone(), here, text))
        })
        .collect();
    let owner: HashMap<Module, Module> = pieces
        .iter()
        .map(|(file, here, _)| (here.clone(), file.clone()))
        .collect();
    let modules: BTreeSet<Module> = pieces.iter().map(|(file, _, _)| file.clone()).collect();
    let mut krate = Crate {
        modules: owner.keys().cloned().collect(),
        reexports: HashMap::new(),
    };
    for (_, here, text) in &pieces {
        for used in uses(text, true) {
            let (head, name) = used.rsplit_once("::").unwrap_or(("self", &used));
            if let Some(target) = krate.resolve(head, here) {
                krate
                    .reexports
                    .insert((here.clone(), name.to_string()), target);
            }
        }
    }
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (file, here, text) in &pieces {
        let targets = uses(text, false)
            .into_iter()
            .chain(inline_paths(text))
            .filter_map(|p| krate.resolve(&p, here))
            .map(|t| owner.get(&t).cloned().unwrap_or(t))
            .filter(|t| t != file);
        edges.entry(file.clone()).or_default().extend(targets);
    }
    let imports: usize = edges.values().map(BTreeSet::len).sum();
    assert!(
        modules.len() > 40 && imports > 150,
        "the checker sees the crate: {} modules, {imports} imports",
        modules.len()
    );
    let found = circles(&edges);
    let names: Vec<String> = found
        .iter()
        .map(|c| {
            c.iter()
                .map(|m| m.join("::"))
                .collect::<Vec<_>>()
                .join(" <-> ")
        })
        .collect();
    assert!(names.is_empty(), "import circles: {names:#?}");
}

/// The checker finds the circles it exists for (so its silence above means something).
#[test]
fn the_circle_finder_finds_circles() {
    let m = |s: &str| -> Module { s.split("::").map(String::from).collect() };
    let edges: BTreeMap<Module, BTreeSet<Module>> = [
        ("checkpoint", vec!["data"]),
        ("data", vec!["checkpoint", "util"]),
        ("util", vec![]),
        ("cpu::gemm", vec!["cpu::bf16"]),
        ("cpu::bf16", vec!["cpu::threads"]),
        ("cpu::threads", vec!["cpu::gemm"]),
    ]
    .into_iter()
    .map(|(k, v)| (m(k), v.into_iter().map(m).collect()))
    .collect();
    let mut found: Vec<usize> = circles(&edges).iter().map(Vec::len).collect();
    found.sort();
    assert_eq!(found, vec![2, 3]);
    assert_eq!(
        expand_use("super::{a, b::{c, d as e}}"),
        ["super::a", "super::b::c", "super::b::d"]
    );
    let file: Module = m("cpu::amx");
    let split = inline_modules(
        "use super::panels;\nmod convert {\n    fn f() { super::g(); }\n    pub mod deep {\n        fn h() {}\n    }\n}\nfn g() {}\n",
        &file,
    );
    let at: Vec<String> = split.iter().map(|(m, _)| m.join("::")).collect();
    assert_eq!(
        at,
        ["cpu::amx", "cpu::amx::convert", "cpu::amx::convert::deep"]
    );
    assert!(split[0].1.contains("fn g()") && !split[0].1.contains("super::g"));
    assert!(split[1].1.contains("super::g") && !split[1].1.contains("fn h"));
}

/// Files of src/ whose code (comments and unit tests aside) contains `needle`.
fn files_containing(needle: &str) -> Vec<String> {
    sources()
        .into_iter()
        .filter(|(_, text)| text.contains(needle))
        .map(|(p, _)| p.strip_prefix(src()).unwrap().display().to_string())
        .collect()
}

#[test]
fn the_model_is_described_once() {
    // Parameter names (as written in code: string literals), and the fused q | k | v
    // width (H + 2 H_kv) d.
    for needle in [
        "\"wte.weight\"",
        "\"wpe.weight\"",
        "\"attn.c_attn\"",
        "\"attn.c_proj\"",
        "\"mlp.c_fc\"",
        "\"mlp.c_proj\"",
        "\"ln_f\"",
        "\"ln_1\"",
        "\"ln_2\"",
        "2 * kv_width",
    ] {
        assert_eq!(files_containing(needle), ["model/spec.rs"], "{needle}");
    }
}

#[test]
fn the_trainer_eval_and_bench_never_ask_which_engine() {
    for file in ["train/mod.rs", "train/start.rs", "eval.rs", "bench.rs"] {
        let text = code_only(&std::fs::read_to_string(src().join(file)).unwrap());
        for engine_type in [
            "FusedCpu",
            "ReferenceEngine",
            "fused_cpu",
            "engine::reference",
            "Engine::",
        ] {
            assert!(!text.contains(engine_type), "{file} names {engine_type}");
        }
    }
}
