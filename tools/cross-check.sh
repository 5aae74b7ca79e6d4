#!/usr/bin/env bash
# The platforms this Linux machine can check without them (issue 40), as tools/test.sh
# runs it:
#
#   1. macOS, compiled for real: clippy -D warnings over every target for
#      aarch64-apple-darwin (Apple Silicon) and x86_64-apple-darwin with the `metal` and
#      `accelerate` features; the C in our dependencies (zstd) compiled by Zig's C
#      compiler, which carries macOS's libc headers (PyPI's `ziglang`, in a venv).
#      Nothing is linked: Apple's frameworks are not here.
#   2. Windows: the same clippy for x86_64-pc-windows-gnu (Debian's MinGW compiles the C).
#   3. ARM, run: the CPU's numeric core built for aarch64-unknown-linux-gnu (Debian's
#      cross gcc links it) and run under qemu-aarch64 (Debian's qemu-user): the library's
#      unit tests, tests/isa.rs (the f32 GEMM on the crate's NEON micro-kernels against
#      f64, every vector kernel, the fused engine against the reference), tests/engines.rs
#      (the fused engine against the reference: losses, every gradient, bf16 products),
#      tests/model.rs (worked examples, finite differences), tests/generate.rs (the K/V
#      cache against the full forward, the CPU decoders, int8) and tests/train.rs
#      (training, resume bit for bit). Tests that start the tinygpt binary are left out:
#      an ARM binary runs only through qemu, and no binfmt handler is registered here.
#
# What it needs is installed where missing (the Rust targets through rustup, Debian's
# packages through apt-get, Zig through pip); where that cannot be done it says
# SKIPPED, naming what is missing, and exits 0, as the CUDA check does. A warning or a
# failing test exits non-zero.
#
#   tools/cross-check.sh            # all three
#   tools/cross-check.sh macos      # or windows, arm: one of them
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${XDG_CACHE_HOME:-$HOME/.cache}/tinygpt-cross"
# Its own target folder: these builds evict neither the CPU build nor the CUDA one.
export CARGO_TARGET_DIR="${TINYGPT_CROSS_TARGET_DIR:-target-cross}"
parts=("${@:-macos windows arm}")
read -r -a parts <<<"${parts[*]}"

skipped() {
  echo "SKIPPED: $1" >&2
}

as_root=""
[ "$(id -u)" = 0 ] || as_root="sudo -n"
# apt_install WHAT=PACKAGE ...: installs each PACKAGE whose WHAT (a command, or a path
# from /) is missing.
apt_install() {
  local missing=() what
  for pair in "$@"; do
    what=${pair%%=*}
    if [[ $what == /* ]]; then [ -e "$what" ]; else command -v "$what" >/dev/null; fi ||
      missing+=("${pair#*=}")
  done
  [ ${#missing[@]} = 0 ] && return 0
  command -v apt-get >/dev/null || return 1
  echo "installing ${missing[*]} (apt-get) for the cross checks" >&2
  { $as_root apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq "${missing[@]}" >/dev/null; } || return 1
}

rust_target() {
  rustup target list --installed 2>/dev/null | grep -x "$1" >/dev/null && return 0
  echo "adding the Rust target $1 (rustup)" >&2
  rustup target add "$1" >/dev/null 2>&1
}

# Zig's C compiler for one target (aarch64-macos, ...), as a wrapper that drops the
# flags cc-rs gives Apple's clang and Zig takes otherwise (-arch, the deployment target
# comes with -target).
zig_cc() {
  local zig_target=$1 wrapper="$cache/zig-cc-$1"
  if [ ! -x "$cache/venv/bin/python" ] || ! "$cache/venv/bin/python" -m ziglang version >/dev/null 2>&1; then
    echo "installing Zig's C compiler (pip: ziglang) into $cache/venv" >&2
    mkdir -p "$cache"
    { python3 -m venv "$cache/venv" && "$cache/venv/bin/pip" install -q ziglang; } >&2 || return 1
  fi
  cat >"$wrapper" <<EOF
#!/usr/bin/env bash
args=()
skip=0
for a in "\$@"; do
  if [ \$skip = 1 ]; then skip=0; continue; fi
  case "\$a" in
    -arch) skip=1 ;;
    -mmacosx-version-min=*|--target=*) ;;
    *) args+=("\$a") ;;
  esac
done
exec "$cache/venv/bin/python" -m ziglang cc -target $zig_target "\${args[@]}"
EOF
  chmod +x "$wrapper"
  echo "$wrapper"
}

check_macos() {
  for target in aarch64-apple-darwin x86_64-apple-darwin; do
    local zig_target=${target%%-*}-macos cc
    if ! rust_target "$target"; then
      skipped "macOS ($target): rustup could not add the target (no network to static.rust-lang.org?)"
      continue
    fi
    if ! cc=$(zig_cc "$zig_target"); then
      skipped "macOS ($target): Zig's C compiler could not be installed (pip install ziglang)"
      continue
    fi
    echo "== clippy for $target --features metal,accelerate" >&2
    env "CC_${target//-/_}=$cc" cargo clippy --target "$target" --features metal,accelerate \
      --all-targets -- -D warnings
  done
}

check_windows() {
  local target=x86_64-pc-windows-gnu
  if ! rust_target "$target"; then
    skipped "Windows: rustup could not add $target (no network to static.rust-lang.org?)"
    return 0
  fi
  if ! apt_install x86_64-w64-mingw32-gcc=gcc-mingw-w64-x86-64; then
    skipped "Windows: no MinGW C compiler (apt install gcc-mingw-w64-x86-64)"
    return 0
  fi
  echo "== clippy for $target" >&2
  cargo clippy --target "$target" --all-targets -- -D warnings
}

check_arm() {
  local target=aarch64-unknown-linux-gnu
  if ! rust_target "$target"; then
    skipped "ARM: rustup could not add $target (no network to static.rust-lang.org?)"
    return 0
  fi
  if ! apt_install aarch64-linux-gnu-gcc=gcc-aarch64-linux-gnu qemu-aarch64=qemu-user \
    /usr/aarch64-linux-gnu/include/stdio.h=libc6-dev-arm64-cross; then
    skipped "ARM: no cross gcc or qemu-user (apt install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)"
    return 0
  fi
  echo "== the CPU's numeric core on $target, under qemu-aarch64" >&2
  # Without line tables (a failure still names its file and line: that is compiled into
  # the panic), the slowest part of the test command builds faster.
  CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu" \
    CC_aarch64_unknown_linux_gnu=aarch64-linux-gnu-gcc \
    CARGO_PROFILE_DEV_DEBUG=0 cargo test --target "$target" --lib --test isa --test engines --test model \
    --test generate --test train -- --skip the_environment_caps_the_level \
    --skip f32_weights_decode_alike_mapped_or_copied
}

for part in "${parts[@]}"; do
  case "$part" in
    macos) check_macos ;;
    windows) check_windows ;;
    arm) check_arm ;;
    *)
      echo "error: no platform '$part' (macos, windows, arm)" >&2
      exit 2
      ;;
  esac
done
echo "cross checks (${parts[*]}): clean" >&2
