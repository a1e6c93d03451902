"""Peer kernels for the benchmark, built from the peers' own PyPI wheels (never vendored).

Both peers ship their CUDA sources in the wheel and JIT-build them through apache-tvm-ffi. The
device machine has no network and cannot install their dependencies, so this module builds the
same sources the way their loaders do (same template arguments, defines and architecture flags,
same tvm-ffi exports) and loads them with `tvm_ffi`, without importing `sglang` or `flashinfer`:

    SGL_BENCH_SGLANG_DIR      holds `sglang/kernels/jit` (unzipped from sglang-0.5.23-*.whl)
    SGL_BENCH_FLASHINFER_DIR  holds `flashinfer/data` (unzipped from flashinfer_python-0.7.2*.whl)
    PYTHONPATH                must make `tvm_ffi` importable (apache-tvm-ffi for that Python)

Modules are cached under `$SGL_EXT_CACHE_DIR/peers` (default ~/.cache/sgl_ext) by a key that
holds no absolute path, so a cache built on a CPU machine with nvcc (`python
benchmarks/peers.py --arch 90`) can be carried to the GPU machine. Loaders raise
`PeerUnavailable` saying what is missing.

Peers (all called with our benchmark's tensors; cos/sin fp32 [max_pos, rot], first half cos):
  sglang_fused           SGLang's fused RoPE + K/V store (`rope.cuh`, FusedRopeKernel::run_fused)
  sglang_rope            SGLang's RoPE alone (`rope.cuh`, FusedRopeKernel::run)
  flashinfer_rope        FlashInfer's in-place RoPE from a cos/sin cache (no cache write)
  flashinfer_fp8_append  FlashInfer's RoPE + fp8 quantisation (q too) + paged K/V append
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import sys
import tempfile

import nvcc_build  # benchmarks/: nvcc lookup, cache directory and atomic build
import torch

_FFI_INCLUDES = "".join(
    f"#include <tvm/ffi/{h}>\n"
    for h in ("container/tensor.h", "dtype.h", "error.h", "extra/c_env_api.h", "function.h")
)
_CPP_DTYPE = {torch.bfloat16: "bf16_t", torch.float16: "fp16_t"}


class PeerUnavailable(RuntimeError):
    """A peer kernel cannot be built or loaded here (the reason is the message)."""


def _root(var: str, probe: str) -> pathlib.Path:
    root = os.environ.get(var)
    if not root:
        raise PeerUnavailable(f"{var} is not set")
    if not (pathlib.Path(root) / probe).is_file():
        raise PeerUnavailable(f"{root}/{probe} not found")
    return pathlib.Path(root)


def _tvm_ffi():
    try:
        import tvm_ffi
        from tvm_ffi import libinfo
    except ImportError as err:
        raise PeerUnavailable(f"tvm_ffi is not importable ({err})") from err
    return tvm_ffi, libinfo


def _build(
    name: str,
    sources: list[pathlib.Path],
    headers: list[pathlib.Path],
    wrapper: str,
    includes: list[pathlib.Path],
    flags: list[str],
    arch: int,
) -> pathlib.Path:
    """nvcc sources + wrapper (a generated translation unit) into a shared library, cached by
    the text of the wrapper, sources and headers (the peer's own files) and the flags."""
    tvm_ffi, libinfo = _tvm_ffi()
    sm = f"{arch}a" if arch >= 90 else str(arch)  # the peers' loaders: "a" targets from sm_90
    target = f"-gencode=arch=compute_{sm},code=sm_{sm}"
    key_text = "\n".join([wrapper, *flags, target, tvm_ffi.__version__])
    key_text += "".join(p.read_text() for p in sources + headers)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    out = nvcc_build.cache_dir() / "peers" / f"{name}_{key}.so"
    if out.is_file():
        return out
    nvcc = nvcc_build.find_nvcc()
    if nvcc is None:
        raise PeerUnavailable("nvcc not found")
    lib = pathlib.Path(libinfo.find_libtvm_ffi())
    inc = [libinfo.find_include_path(), libinfo.find_dlpack_include_path(), *map(str, includes)]
    with tempfile.TemporaryDirectory() as tmp:
        cu = pathlib.Path(tmp) / "wrapper.cu"
        cu.write_text(wrapper)
        units = [str(cu)] if wrapper else []  # FlashInfer's binding exports its own entries
        args = [
            *flags,
            target,
            "-Xcompiler",
            "-fPIC",
            "-shared",
            *(f"-I{p}" for p in dict.fromkeys(inc)),
            *units,
            *map(str, sources),
            f"-L{lib.parent}",
            f"-l{lib.stem.removeprefix('lib')}",
        ]
        try:
            nvcc_build.run_nvcc(nvcc, args, out)
        except nvcc_build.BuildError as err:
            raise PeerUnavailable(f"nvcc failed for {name}:\n{str(err)[-3000:]}") from err
    return out


@functools.cache
def _load(path: pathlib.Path):
    tvm_ffi, _ = _tvm_ffi()
    return tvm_ffi.load_module(str(path))


def _arch() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


# SGLang 0.5.23: `sglang/kernels/jit/csrc/elementwise/rope.cuh`, built as its load_jit does.
def build_sglang(is_neox: bool, rope_dim: int, pdl: bool, dtype: torch.dtype, arch: int):
    jit = _root("SGL_BENCH_SGLANG_DIR", "sglang/kernels/jit/csrc/elementwise/rope.cuh")
    jit = jit / "sglang" / "kernels" / "jit"
    args = ", ".join(
        [
            "true" if is_neox else "false",
            str(rope_dim),
            "true" if pdl else "false",
            _CPP_DTYPE[dtype],
            _CPP_DTYPE[dtype],
        ]
    )
    entry = f"FusedRopeKernel<{args}>::run_fused"
    wrapper = _FFI_INCLUDES + '#include "elementwise/rope.cuh"\nnamespace sglang {\n'
    wrapper += f"TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_rope_store, ({entry}));\n}}\n"
    flags = [f"-DSGL_CUDA_ARCH={arch * 10}", "-std=c++20", "-O3", "--expt-relaxed-constexpr"]
    return _build(
        "sglang_rope",
        [],
        [jit / "csrc/elementwise/rope.cuh"],
        wrapper,
        [jit / "include", jit / "csrc"],
        flags,
        arch,
    )


def build_sglang_rope(is_neox: bool, rope_dim: int, pdl: bool, dtype: torch.dtype, arch: int):
    """SGLang's RoPE alone (`FusedRopeKernel::run`, its `apply_rope_inplace`), a module of its
    own so the fused module's cache key stays as it was."""
    jit = _root("SGL_BENCH_SGLANG_DIR", "sglang/kernels/jit/csrc/elementwise/rope.cuh")
    jit = jit / "sglang" / "kernels" / "jit"
    neox, use_pdl = ("true" if b else "false" for b in (is_neox, pdl))
    args = f"{neox}, {rope_dim}, {use_pdl}, {_CPP_DTYPE[dtype]}, {_CPP_DTYPE[dtype]}"
    wrapper = _FFI_INCLUDES + '#include "elementwise/rope.cuh"\nnamespace sglang {\n'
    wrapper += f"TVM_FFI_DLL_EXPORT_TYPED_FUNC(run_rope, (FusedRopeKernel<{args}>::run));\n}}\n"
    flags = [f"-DSGL_CUDA_ARCH={arch * 10}", "-std=c++20", "-O3", "--expt-relaxed-constexpr"]
    includes = [jit / "include", jit / "csrc"]
    headers = [jit / "csrc/elementwise/rope.cuh"]
    return _build("sglang_rope_only", [], headers, wrapper, includes, flags, arch)


def sglang_rope(is_neox: bool, rope_dim: int, dtype: torch.dtype):
    """fn(pos, q, k, cos_sin): SGLang's RoPE in place on q [T, Hq, D] and k [T, Hkv, D]."""
    if dtype not in _CPP_DTYPE:
        raise PeerUnavailable(f"SGLang's kernel takes bf16/fp16, not {dtype}")
    arch = _arch()
    run = _load(build_sglang_rope(is_neox, rope_dim, arch >= 90, dtype, arch))["run_rope"]
    return lambda pos, q, k, cs: run(q, k, cs, pos)


def sglang_fused(is_neox: bool, rope_dim: int, dtype: torch.dtype):
    """fn(pos, q, k, v, cos_sin, k_cache, v_cache, loc): q [T, Hq, D], k/v [T, Hkv, D] (one head
    stride), caches [slots, Hkv * D], pos/loc of one index dtype; PDL on sm_90+ as SGLang does."""
    if dtype not in _CPP_DTYPE:
        raise PeerUnavailable(f"SGLang's kernel takes bf16/fp16, not {dtype}")
    arch = _arch()
    run = _load(build_sglang(is_neox, rope_dim, arch >= 90, dtype, arch))["run_rope_store"]
    return lambda pos, q, k, v, cs, kc, vc, loc: run(q, k, v, kc, vc, cs, pos, loc)


def _sglang_jit(header: str) -> pathlib.Path:
    root = _root("SGL_BENCH_SGLANG_DIR", f"sglang/kernels/jit/csrc/elementwise/{header}")
    return root / "sglang" / "kernels" / "jit"


# SGLang 0.5.23: `qknorm.cuh` (in-place RMSNorm of q and k heads, strided views), as load_jit.
def build_sglang_qknorm(head_dim: int, pdl: bool, dtype: torch.dtype, arch: int):
    jit = _sglang_jit("qknorm.cuh")
    entry = f"QKNormKernel<{head_dim}, {'true' if pdl else 'false'}, {_CPP_DTYPE[dtype]}>::run"
    wrapper = _FFI_INCLUDES + '#include "elementwise/qknorm.cuh"\nnamespace sglang {\n'
    wrapper += f"TVM_FFI_DLL_EXPORT_TYPED_FUNC(qknorm, ({entry}));\n}}\n"
    flags = [f"-DSGL_CUDA_ARCH={arch * 10}", "-std=c++20", "-O3", "--expt-relaxed-constexpr"]
    header = [jit / "csrc/elementwise/qknorm.cuh"]
    return _build(
        "sglang_qknorm", [], header, wrapper, [jit / "include", jit / "csrc"], flags, arch
    )


def sglang_qknorm(head_dim: int, dtype: torch.dtype):
    """fn(q, k, q_weight, k_weight, eps): RMSNorm in place of q [T, Hq, D], k [T, Hkv, D]."""
    if dtype not in _CPP_DTYPE:
        raise PeerUnavailable(f"SGLang's qknorm takes bf16/fp16, not {dtype}")
    arch = _arch()
    return _load(build_sglang_qknorm(head_dim, arch >= 90, dtype, arch))["qknorm"]


# SGLang 0.5.23: `fused_qknorm_rope.cuh` (TRT-LLM's q/k norm + RoPE, no cache write; bf16, a
# contiguous qkv, cos/sin computed from the base), built with its JIT_* defines.
def build_sglang_qknorm_rope(head_dim: int, interleave: bool, arch: int):
    jit = _sglang_jit("fused_qknorm_rope.cuh")
    wrapper = _FFI_INCLUDES + '#include "elementwise/fused_qknorm_rope.cuh"\n'
    wrapper += "TVM_FFI_DLL_EXPORT_TYPED_FUNC(fused_qk_norm_rope, sglang::fused_qk_norm_rope);\n"
    flags = [
        f"-DSGL_CUDA_ARCH={arch * 10}",
        f"-DJIT_HEAD_DIM={head_dim}",
        f"-DJIT_INTERLEAVE={int(interleave)}",
        "-DJIT_YARN=0",
        "-std=c++20",
        "-O3",
        "--expt-relaxed-constexpr",
    ]
    header = [jit / "csrc/elementwise/fused_qknorm_rope.cuh"]
    includes = [jit / "include", jit / "csrc"]
    return _build("sglang_qknorm_rope", [], header, wrapper, includes, flags, arch)


def sglang_qknorm_rope(head_dim: int, is_neox: bool, base: float, hq: int, hkv: int):
    """fn(qkv, q_weight, k_weight, pos32, eps): q/k norm + RoPE in place on a contiguous bf16
    qkv [T, (Hq + 2 Hkv) * D] (positions int32, full rotary, no cache write)."""
    run = _load(build_sglang_qknorm_rope(head_dim, not is_neox, _arch()))["fused_qk_norm_rope"]

    def fn(qkv, qw, kw, pos32, eps):
        # factor 1 (no YaRN), low/high unused, attention factor 1, rotary_dim = head_dim
        run(
            qkv,
            qw,
            kw,
            pos32,
            hq,
            hkv,
            hkv,
            head_dim,
            eps,
            base,
            int(is_neox),
            1.0,
            0.0,
            0.0,
            1.0,
            head_dim,
        )

    return fn


# FlashInfer 0.7.2: `flashinfer/data/csrc/rope.cu` + its binding, built as gen_rope_module does.
def build_flashinfer(arch: int):
    data = _root("SGL_BENCH_FLASHINFER_DIR", "flashinfer/data/csrc/rope.cu") / "flashinfer/data"
    cccl = data / "cccl"
    flags = [
        "-std=c++17",
        "-use_fast_math",
        "-DFLASHINFER_ENABLE_F16",
        "-DFLASHINFER_ENABLE_BF16",
        "-DFLASHINFER_ENABLE_FP8_E4M3",
        "-DFLASHINFER_ENABLE_FP8_E5M2",
        "-DNDEBUG",
        "-O3",
    ]
    includes = [
        cccl / "cub",
        cccl / "libcudacxx/include",
        cccl / "thrust",
        data / "include",
        data / "csrc",
    ]
    sources = [data / "csrc/rope.cu", data / "csrc/flashinfer_rope_binding.cu"]
    headers = [data / "include/flashinfer/pos_enc.cuh"]
    return _build("flashinfer_rope", sources, headers, "", includes, flags, arch)


def flashinfer_rope(is_neox: bool):
    """fn(pos, q, k, cos_sin): RoPE in place on q [T, Hq, D] and k [T, Hkv, D] (no cache)."""
    run = _load(build_flashinfer(_arch()))["apply_rope_pos_ids_cos_sin_cache"]
    return lambda pos, q, k, cs: run(q, k, q, k, cs, pos, not is_neox)


def flashinfer_fp8_append(
    is_neox: bool, kv_scale: float, k_cache: torch.Tensor, v_cache: torch.Tensor, num_tokens: int
):
    """fn(pos, q, k, v, cos_sin, loc32, q_out): RoPE, q to fp8 into q_out [T, Hq, D], K and V
    times 1/kv_scale into the fp8 caches [slots, Hkv, D] at slots loc32 (int32; pages of one
    slot, NHD); PDL on. q, k, v: [T, H, D] views."""
    run = _load(build_flashinfer(_arch()))["rope_quantize_append_paged_kv_cache"]
    i32 = dict(dtype=torch.int32, device=k_cache.device)
    indptr, batch = torch.arange(num_tokens + 1, **i32), torch.arange(num_tokens, **i32)
    in_page = torch.zeros(num_tokens, **i32)  # position inside the one-slot page
    unused = torch.empty(0, dtype=k_cache.dtype, device=k_cache.device)  # MLA caches
    kc4, vc4 = k_cache.unsqueeze(1), v_cache.unsqueeze(1)  # [slots, 1 (page), Hkv, D]

    def fn(pos, q, k, v, cs, loc32, q_out):
        # [T, H, 0] views: no pass-through dims
        run(
            q,
            k,
            q[:, :, :0],
            k[:, :, :0],
            v,
            q_out,
            q_out[:, :, :0],
            cs,
            pos,
            kc4,
            vc4,
            unused,
            unused,
            loc32,
            indptr,
            batch,
            in_page,
            0,
            1,
            1.0,
            1.0 / kv_scale,
            not is_neox,
            True,
        )

    return fn


if __name__ == "__main__":
    arch = int(sys.argv[sys.argv.index("--arch") + 1]) if "--arch" in sys.argv else 90
    for neox, dim in ((True, 128), (True, 64), (False, 128), (False, 64)):
        try:
            print(build_sglang(neox, dim, True, torch.bfloat16, arch))
            print(build_sglang_rope(neox, dim, True, torch.bfloat16, arch))
        except PeerUnavailable as err:
            print("sglang:", err)
    for build in (
        lambda: build_sglang_qknorm(128, True, torch.bfloat16, arch),
        lambda: build_sglang_qknorm_rope(128, False, arch),
    ):
        try:
            print(build())
        except PeerUnavailable as err:
            print("sglang qknorm:", err)
    try:
        print(build_flashinfer(arch))
    except PeerUnavailable as err:
        print("flashinfer:", err)
