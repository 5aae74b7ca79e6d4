//! The documentation points only inside the repository, at things that exist: every
//! relative link of README.md and docs/*.md names a file of the repository, and every
//! `#anchor` a heading of the file it points into.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The markdown files users read.
fn documents() -> Vec<PathBuf> {
    // checkpoints/README.md is what a user finds beside their runs.
    let mut docs = vec![
        root().join("README.md"),
        root().join("checkpoints/README.md"),
    ];
    let mut more: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    more.sort();
    docs.extend(more);
    docs
}

/// The targets of `[text](target)` links, outside code blocks.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        }
        if fenced || line.starts_with("    ") {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            out.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    out
}

/// GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.starts_with('#'))
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

#[test]
fn every_link_of_the_documentation_resolves_inside_the_repository() {
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        let name = doc.strip_prefix(root()).unwrap().display().to_string();
        assert!(
            !text.contains("../shared"),
            "{name} points outside the repository"
        );
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") {
                continue;
            }
            let (file, anchor) = match link.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (link.as_str(), None),
            };
            let target = if file.is_empty() {
                doc.clone()
            } else {
                doc.parent().unwrap().join(file)
            };
            let target = target.canonicalize().unwrap_or(target);
            assert!(
                target.starts_with(root()) && Path::new(&target).exists(),
                "{name}: {link} does not name a file of the repository"
            );
            if let Some(anchor) = anchor {
                let there = std::fs::read_to_string(&target).unwrap();
                assert!(
                    anchors(&there).iter().any(|a| a == anchor),
                    "{name}: {link}: no heading #{anchor} there"
                );
            }
            checked += 1;
        }
    }
    assert!(checked > 20, "{checked} links checked");
}

#[test]
fn the_slugs_are_githubs() {
    assert_eq!(
        slug(" Several processes (MPI, NCCL)"),
        "several-processes-mpi-nccl"
    );
    assert_eq!(
        slug("Generating: how decoding works"),
        "generating-how-decoding-works"
    );
    assert_eq!(
        links("see [a](docs/A.md#x) and [b](#y)\n    [not](code)"),
        vec!["docs/A.md#x", "#y"]
    );
}
