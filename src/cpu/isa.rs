//! Which vector instructions the CPU kernels use: the best the CPU has, capped by the
//! environment variable `TINYGPT_CPU_ISA` (`amx`, `avx512`, `avx2` or `scalar`), as oneDNN's
//! `ONEDNN_MAX_CPU_ISA` caps oneDNN. So any machine can run, measure and test the path a
//! laptop without AVX-512 takes. Every kernel we dispatch reads [`active`]: our
//! multiversioned loops, the f32 GEMM (the `gemm` crate's micro-kernels, chosen here
//! rather than by the crate) and the bf16 GEMM.
//!
//! On other architectures (aarch64) every kernel runs its portable Rust, which the
//! compiler vectorises for the target's baseline (NEON on aarch64); the level there is
//! `scalar` in the sense of "no x86 dispatch".

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// The environment variable that caps the level.
pub const ENV: &str = "TINYGPT_CPU_ISA";

/// A dispatch level, ordered: each includes the ones below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Isa {
    /// Portable Rust, compiled for the baseline of the target.
    Scalar,
    /// AVX2 with FMA (x86-64-v3).
    Avx2,
    /// AVX-512 F/BW/DQ/VL (x86-64-v4).
    Avx512,
    /// AVX-512 and AMX tiles with bf16 products (Intel Xeon from Sapphire Rapids on,
    /// where the OS grants them): bf16 training's products run on the tiles.
    Amx,
}

impl Isa {
    pub const ALL: [Isa; 4] = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Amx];

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }

    pub fn parse(s: &str) -> Option<Isa> {
        Isa::ALL
            .into_iter()
            .find(|isa| isa.name() == s.trim().to_ascii_lowercase())
    }

    /// The best level this CPU has.
    pub fn detected() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                use std::arch::is_x86_feature_detected as has;
                // F16C (f16 scales) and FMA come with AVX2 on every CPU that has it; checked
                // so that no kernel meets a CPU without them.
                let base = has!("avx2") && has!("fma") && has!("f16c");
                if base
                    && has!("avx512f")
                    && has!("avx512bw")
                    && has!("avx512dq")
                    && has!("avx512vl")
                {
                    if amx_ready() {
                        return Isa::Amx;
                    }
                    return Isa::Avx512;
                }
                if base {
                    return Isa::Avx2;
                }
            }
            Isa::Scalar
        })
    }

    /// Every level this CPU can run, lowest first.
    pub fn supported() -> Vec<Isa> {
        Isa::ALL
            .into_iter()
            .filter(|&isa| isa <= Isa::detected())
            .collect()
    }
}

/// The cap `TINYGPT_CPU_ISA` sets: `Ok(None)` when unset, `Err` (naming the variable and
/// its values) when it is not a level.
pub fn cap_from_env() -> Result<Option<Isa>, String> {
    match std::env::var(ENV) {
        Err(_) => Ok(None),
        Ok(value) if value.trim().is_empty() => Ok(None),
        Ok(value) => Isa::parse(&value).map(Some).ok_or_else(|| {
            format!(
                "{ENV}={value:?} is not a CPU level; use amx, avx512, avx2 or scalar (or unset it)"
            )
        }),
    }
}

/// 0: not forced; otherwise the forced level's index + 1.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The level every kernel uses now: the CPU's best, capped by `TINYGPT_CPU_ISA` (an
/// invalid value is ignored here; the CLI refuses it at startup), or the level
/// [`force`] set.
pub fn active() -> Isa {
    static CAPPED: OnceLock<Isa> = OnceLock::new();
    match FORCED.load(Ordering::Relaxed) {
        0 => *CAPPED.get_or_init(|| match cap_from_env() {
            Ok(Some(cap)) => cap.min(Isa::detected()),
            _ => Isa::detected(),
        }),
        n => Isa::ALL[n as usize - 1],
    }
}

/// Makes every kernel run at `level` (`None`: back to [`active`]'s own choice), for
/// tests that compare the levels in one process. Panics if the CPU cannot run it. Not
/// for use while kernels run on other threads.
pub fn force(level: Option<Isa>) {
    if let Some(level) = level {
        assert!(
            level <= Isa::detected(),
            "this CPU cannot run {}",
            level.name()
        );
    }
    let code = level.map_or(0, |l| {
        Isa::ALL.iter().position(|&x| x == l).unwrap() as u8 + 1
    });
    FORCED.store(code, Ordering::Relaxed);
}

/// The vector features this CPU has that matter to our kernels and to other libraries
/// (x86: fma, avx2, avx512*; aarch64: neon, ...), for reports.
pub fn cpu_features() -> Vec<&'static str> {
    let mut out = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let features = [
            ("fma", has!("fma")),
            ("avx2", has!("avx2")),
            ("avx512f", has!("avx512f")),
            ("avx512bw", has!("avx512bw")),
            ("avx512vl", has!("avx512vl")),
            ("avx512dq", has!("avx512dq")),
            ("avx512vnni", has!("avx512vnni")),
            ("avxvnni", has!("avxvnni")),
            ("avx512bf16", has!("avx512bf16")),
            // Tiles the OS granted this process, not only the CPUID bits.
            ("amx-bf16", amx_ready()),
        ];
        out.extend(
            features
                .into_iter()
                .filter(|(_, has)| *has)
                .map(|(name, _)| name),
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        use std::arch::is_aarch64_feature_detected as has;
        let features = [
            ("neon", has!("neon")),
            ("bf16", has!("bf16")),
            ("sve", has!("sve")),
        ];
        out.extend(
            features
                .into_iter()
                .filter(|(_, has)| *has)
                .map(|(name, _)| name),
        );
    }
    out
}

/// The CPU's model name (Linux), for reports that give a figure with its machine.
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("model name"))?;
    Some(line.split_once(':')?.1.trim().to_string())
}

/// The CPU family when AMD made this CPU (25: Zen 3 and Zen 4; 26: Zen 5), `None` for any
/// other maker or architecture: kernels tuned per core pick their variant by it. Asked once.
pub fn amd_family() -> Option<u32> {
    static FAMILY: OnceLock<Option<u32>> = OnceLock::new();
    *FAMILY.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::x86_64::__cpuid;
            let leaf = __cpuid(0);
            let vendor: Vec<u8> = [leaf.ebx, leaf.edx, leaf.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            // CPUID 1: the base family (bits 8-11), plus the extended one (bits 20-27)
            // where the base is 15.
            let eax = __cpuid(1).eax;
            let base = (eax >> 8) & 0xf;
            let family = base + if base == 0xf { (eax >> 20) & 0xff } else { 0 };
            (vendor == b"AuthenticAMD").then_some(family)
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    })
}

/// Whether this CPU has AVX-512 VNNI (`vpdpbusd`), for the integer products that
/// use it beside the `avx512` level. Asked once.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512_vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vnni"))
}

/// Whether this CPU has AVX-VNNI (`vpdpbusd` on 256-bit vectors in the VEX encoding:
/// Intel's cores from Alder Lake on, AVX-512 or not, and AMD's from Zen 5 on), for the
/// integer products at the `avx2` level. Asked once.
#[cfg(target_arch = "x86_64")]
pub fn has_avx_vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| std::arch::is_x86_feature_detected!("avxvnni"))
}

/// Whether this CPU has AVX-512 BF16 (`vdpbf16ps`; on Intel, the cores from Cooper /
/// Sapphire Rapids on). Asked once.
#[cfg(target_arch = "x86_64")]
pub fn has_avx512_bf16() -> bool {
    static BF16: OnceLock<bool> = OnceLock::new();
    *BF16.get_or_init(|| std::arch::is_x86_feature_detected!("avx512bf16"))
}

/// Whether this CPU has AMX tiles with bf16 products and the kernel granted this
/// process their register state. Asked once; safe to call from any thread.
pub fn amx_ready() -> bool {
    static READY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *READY.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            // CPUID leaf 7: EDX bit 22 is AMX-BF16, bit 24 AMX-TILE.
            let leaf = std::arch::x86_64::__cpuid_count(7, 0);
            // The packers convert with AVX-512 BF16 (every CPU with AMX has it).
            let bf16 = has_avx512_bf16() && std::arch::is_x86_feature_detected!("avx512bw");
            if !bf16 || leaf.edx & (1 << 22) == 0 || leaf.edx & (1 << 24) == 0 {
                return false;
            }
            const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
            const XFEATURE_XTILEDATA: libc::c_long = 18;
            // Safety: a plain system call; it fails cleanly on kernels without AMX.
            unsafe {
                libc::syscall(
                    libc::SYS_arch_prctl,
                    ARCH_REQ_XCOMP_PERM,
                    XFEATURE_XTILEDATA,
                ) == 0
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        false
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_parse_order_and_name() {
        assert_eq!(Isa::parse("AVX2"), Some(Isa::Avx2));
        assert_eq!(Isa::parse(" scalar "), Some(Isa::Scalar));
        assert_eq!(Isa::parse("sse4"), None);
        assert!(Isa::Scalar < Isa::Avx2 && Isa::Avx2 < Isa::Avx512 && Isa::Avx512 < Isa::Amx);
        for isa in Isa::ALL {
            assert_eq!(Isa::parse(isa.name()), Some(isa));
        }
        assert!(Isa::supported().contains(&Isa::Scalar));
        assert_eq!(Isa::supported().last(), Some(&Isa::detected()));
    }
}
