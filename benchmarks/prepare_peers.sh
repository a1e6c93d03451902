#!/usr/bin/env bash
# Prepare the ignored .ab/peers directory that gpu_run.sh's peer targets carry to the GPU
# machine (which has no network): the parts of the SGLang and FlashInfer wheels that hold their
# RoPE kernels, apache-tvm-ffi for the device's Python, and the peer modules prebuilt with the
# local nvcc. Run on a CPU machine with network access and nvcc:
#   bash benchmarks/prepare_peers.sh [device python version, default 3.12] [sm arch, default 90]
set -eu
PYV=${1:-3.12}; ARCH=${2:-90}
P=$PWD/.ab/peers; W=$PWD/.ab/wheels
mkdir -p "$P" "$W"
pip download -q --no-deps -d "$W" sglang==0.5.23 flashinfer-python==0.7.2.post1
pip download -q --no-deps -d "$W" --only-binary=:all: --python-version "$PYV" apache-tvm-ffi==0.1.15.post2
pip download -q --no-deps -d "$W/local" apache-tvm-ffi==0.1.15.post2
rm -rf "$P/sg" "$P/fi" "$P/py312" "$W/local_site"
unzip -q -o "$W"/sglang-0.5.23-*.whl 'sglang/kernels/jit/include/*' 'sglang/kernels/jit/csrc/elementwise/*' -d "$P/sg"
unzip -q -o "$W"/flashinfer_python-0.7.2.post1-*.whl 'flashinfer/data/csrc/rope.cu' \
  'flashinfer/data/csrc/flashinfer_rope_binding.cu' 'flashinfer/data/csrc/tvm_ffi_utils.h' \
  'flashinfer/data/include/*' 'flashinfer/data/cccl/cub/*' 'flashinfer/data/cccl/thrust/*' \
  'flashinfer/data/cccl/libcudacxx/include/*' -d "$P/fi"
unzip -q -o "$W"/apache_tvm_ffi-0.1.15.post2-cp${PYV/./}-*.whl -d "$P/py312"
unzip -q -o "$W"/local/apache_tvm_ffi-*.whl -d "$W/local_site"
SGL_BENCH_SGLANG_DIR=$P/sg SGL_BENCH_FLASHINFER_DIR=$P/fi SGL_EXT_CACHE_DIR=$P/cache \
  PYTHONPATH=$PWD:$W/local_site PATH=/usr/local/cuda/bin:$PATH python benchmarks/peers.py --arch "$ARCH"
du -sh "$P"
