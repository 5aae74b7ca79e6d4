# What the GPU-machine scripts (gpu-check.sh, gpu-profile.sh) share, sourced from the
# repository root: .gpu/ must be there (tools/gpu-pack.sh packs it on the build machine);
# `unxz_to FILE.xz DEST` unpacks (xz, or Python's lzma where xz is missing); the CUDA
# libraries the machine has (pip packages, the driver's folder) go on LD_LIBRARY_PATH;
# the packed binary is unpacked to $B, once for a run of scripts (TG_UNPACKED).
D=.gpu
[ -d "$D" ] || { echo "no .gpu/: run tools/gpu-pack.sh on the build machine and carry .gpu" >&2; exit 2; }
mkdir -p /tmp/tg/tests
unxz_to() { xz -dc "$1" > "$2" 2>/dev/null ||
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$1" "$2"
  chmod +x "$2"; }
libdirs=$(find /usr /opt -maxdepth 9 \( -name 'libcublas.so.1[2-9]*' -o -name 'libcuda.so.1' \
  -o -name 'libcurand.so.10*' -o -name 'libnvrtc.so.1[2-9]*' -o -name 'libcublasLt.so.1[2-9]*' \
  -o -name 'libcudart.so.1[2-9]*' -o -name 'libnccl.so.2*' \) 2>/dev/null |
  xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${libdirs}${LD_LIBRARY_PATH:-}"
B=/tmp/tg/tinygpt
if [ "${TG_UNPACKED:-0}" != 1 ]; then
  unxz_to "$D/tinygpt.xz" "$B"
  export TG_UNPACKED=1
fi
