# Sourced by the device scripts (device.sh, ab.sh, branches.sh): unpack the carried extras
# (git-ignored, each an xz tarball of unzipped wheels) into /tmp once per machine and put
# them on PYTHONPATH; `jobs` holds pytest-xdist's arguments where it came along.
# - .fa4/fa4.tar.xz: FlashAttention 4 and its deps (apache-tvm-ffi too), a benchmark peer;
# - .tvmffi/tvmffi.tar.xz: apache-tvm-ffi alone (the DSL's launch path), for calls that need
#   no FA4 (a smaller carry);
# - .pyx/xdist.tar.xz: pytest-xdist and execnet (the GPU tests are bound by kernel compiles,
#   which then use every core); .pydeps/xdist.tar.xz: the same plus apache-tvm-ffi.
unpack() {  # unpack TARBALL DIR MARKER [first]: once; DIR goes last on PYTHONPATH (first)
  [ -e "$2/$3" ] || { mkdir -p "$2" && tar -xJf "$1" -C "$2"; }
  if [ "${4:-}" = first ]; then
    export PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$2"
  fi
}
if [ -f .fa4/fa4.tar.xz ]; then
  unpack .fa4/fa4.tar.xz /tmp/fa4 flash_attn
elif [ -f .tvmffi/tvmffi.tar.xz ]; then
  unpack .tvmffi/tvmffi.tar.xz /tmp/tvmffi tvm_ffi
fi
jobs=()
for tarball in .pyx/xdist.tar.xz .pydeps/xdist.tar.xz; do
  if [ -f "$tarball" ]; then
    unpack "$tarball" /tmp/pydeps xdist first
    jobs=(-n "${JOBS:-12}")
    break
  fi
done
