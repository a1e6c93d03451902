// Fused RoPE + KV-cache write, CUDA C++ (built just in time by sgl_ext/cuda/jit.py).
//
// Every thread ("lane") owns 16-byte pieces of one token:
//   rotation lanes  8 rotary pairs of one query or key head (neox: 8 dims of each half; GPT-J:
//                   16 adjacent dims); key lanes also store the rotated pairs into the cache;
//   tail lanes      8 pass-through dims (rot_dim..head_dim) of a key head, into the cache;
//   value lanes     8 dims of a value head, into the cache.
// A token's lanes are laid out [query heads x nr | key heads x nr | key heads x nt | value
// heads x nv] and spread over blockDim.x threads and gridDim.y blocks; threadIdx.y and
// blockIdx.x pick the token. Every load of a lane is issued before its first store; all
// arithmetic is fp32, the key is rounded to its dtype before it is quantised for the cache, so
// the cache holds exactly the key the op returns.
//
// Requirements (checked by the Python launcher, which otherwise uses the Triton kernel): 16-bit
// q/k/v, rows and strides 16-byte aligned, rot_dim % 16 == 0, head dims % 8 == 0.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

struct RopeKVParams {
  void* q;
  void* k;
  const void* v;
  void* k_buf;
  void* v_buf;
  const void* positions;
  const void* cache_loc;
  const float* cos_sin;
  const float* k_scale;  // device-tensor scales (scale mode 2)
  const float* v_scale;
  int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head;  // strides in elements
  int64_t kb_page, kb_off, kb_head, vb_page, vb_off, vb_head;
  int64_t cs_stride;
  int32_t num_tokens, num_q_heads, num_kv_heads, rot_dim, head_dim, v_head_dim;
  int32_t max_pos, num_slots, page_size, page_shift;  // page_shift < 0: not a power of two
  int32_t pos_is64, loc_is64, write_kv, k_scale_mode, v_scale_mode;  // scale 0 none, 1 f, 2 ptr
  float k_inv, v_inv;  // scale mode 1: the reciprocal, computed on the host
};

enum CacheKind { kSame = 0, kE4M3 = 1, kE5M2 = 2 };

// ---------------------------------------------------------------- 8 x 16-bit <-> 8 x fp32
template <typename T>
__device__ __forceinline__ void unpack8(uint4 u, float f[8]);
template <>
__device__ __forceinline__ void unpack8<__nv_bfloat16>(uint4 u, float f[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <>
__device__ __forceinline__ void unpack8<__half>(uint4 u, float f[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  const __half2 p = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}

template <typename T>
__device__ __forceinline__ uint4 pack8(const float f[8]) {
  return make_uint4(pack2<T>(f[0], f[1]), pack2<T>(f[2], f[3]), pack2<T>(f[4], f[5]),
                    pack2<T>(f[6], f[7]));
}

template <int CACHE>
__device__ __forceinline__ uint32_t fp8x4(float a, float b, float c, float d) {
  constexpr __nv_fp8_interpretation_t kind = CACHE == kE4M3 ? __NV_E4M3 : __NV_E5M2;
  // Round to nearest even, saturating: the same bits as clamping to the largest finite value.
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kind);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, kind);
  return lo | (hi << 16);
}

// Store 8 fp32 values (already multiplied by the inverse scale) into the cache at dst.
template <typename T, int CACHE>
__device__ __forceinline__ void store_cache8(void* dst, const float f[8]) {
  if constexpr (CACHE == kSame) {
    *reinterpret_cast<uint4*>(dst) = pack8<T>(f);
  } else {
    *reinterpret_cast<uint2*>(dst) =
        make_uint2(fp8x4<CACHE>(f[0], f[1], f[2], f[3]), fp8x4<CACHE>(f[4], f[5], f[6], f[7]));
  }
}

__device__ __forceinline__ void load_float8(const float* p, float f[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// x / n and x % n; n is uniform across the grid, and a power of two is the common case.
__device__ __forceinline__ int div_rem(int x, int n, int& rem) {
  if ((n & (n - 1)) == 0) {
    rem = x & (n - 1);
    return x >> __popc(n - 1);
  }
  const int q = x / n;
  rem = x - q * n;
  return q;
}

// Element offset of (slot, head) in a cache laid out by (page, offset, head) strides.
__device__ __forceinline__ int64_t slot_offset(int64_t slot, int32_t page_size, int32_t shift,
                                               int64_t page_stride, int64_t off_stride) {
  int64_t page, off;
  if (shift >= 0) {
    page = slot >> shift;
    off = slot & (page_size - 1);
  } else {  // slot < num_slots < 2^31: a 32-bit division
    page = static_cast<uint32_t>(slot) / static_cast<uint32_t>(page_size);
    off = slot - page * page_size;
  }
  return page * page_stride + off * off_stride;
}

// Loads of one token for one lane: issued for every unrolled token before any is used.
struct TokenLoads {
  uint4 a, b;  // the lane's two 16-byte pieces (copy lanes: only a)
  int64_t pos, slot;
};

template <typename T, int CACHE, bool NEOX, int U>
__global__ void __launch_bounds__(512) rope_kv_kernel(const RopeKVParams p) {
  // ---- plan: everything that does not read memory written by the previous kernel, before
  // the dependency wait (it overlaps that kernel's tail).
  const int nr = p.rot_dim >> 4;
  const int q_end = p.num_q_heads * nr;
  const int k_end = q_end + p.num_kv_heads * nr;
  const int nt = (p.head_dim - p.rot_dim) >> 3;
  const int t_end = p.write_kv ? k_end + p.num_kv_heads * nt : k_end;
  const int v_end = p.write_kv ? t_end + p.num_kv_heads * (p.v_head_dim >> 3) : t_end;
  const int lane = blockIdx.y * blockDim.x + threadIdx.x;
  const bool rot = lane < k_end, is_q = lane < q_end, is_v = lane >= t_end;
  const bool to_cache = p.write_kv && !is_q;
  int head, rem;
  if (rot) {
    head = div_rem(is_q ? lane : lane - q_end, nr, rem);
  } else if (!is_v) {
    head = div_rem(lane - k_end, nt, rem);
  } else {
    head = div_rem(lane - t_end, max(p.v_head_dim >> 3, 1), rem);
  }
  const int c = rem * 8;  // rotation lanes: first pair index
  // Element offset of the first piece inside the head, and the second piece's distance.
  const int dim = rot ? (NEOX ? c : 2 * c) : (is_v ? c : p.rot_dim + c);
  const int piece_b = NEOX ? (p.rot_dim >> 1) : 8;
  T* src = static_cast<T*>(is_q ? p.q : (is_v ? const_cast<void*>(p.v) : p.k));
  const int64_t src_tok = is_q ? p.q_tok : (is_v ? p.v_tok : p.k_tok);
  src += head * (is_q ? p.q_head : (is_v ? p.v_head : p.k_head)) + dim;
  char* dst = static_cast<char*>(is_v ? p.v_buf : p.k_buf);
  constexpr int kCacheBytes = CACHE == kSame ? sizeof(T) : 1;
  const int64_t page_stride = (is_v ? p.vb_page : p.kb_page) * kCacheBytes;
  const int64_t off_stride = (is_v ? p.vb_off : p.kb_off) * kCacheBytes;
  dst += ((is_v ? p.vb_head : p.kb_head) * head + dim) * kCacheBytes;
  const int scale_mode = is_v ? p.v_scale_mode : p.k_scale_mode;
  const float* scale_ptr = is_v ? p.v_scale : p.k_scale;
  const float host_inv = is_v ? p.v_inv : p.k_inv;
  const bool active = lane < v_end;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.y;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  // Loop invariants, read before the wait too.
  const int64_t num_tokens = p.num_tokens;
  const void* positions = p.positions;
  const void* cache_loc = p.cache_loc;
  const float* cos_sin = p.cos_sin;
  const int64_t cs_stride = p.cs_stride;
  const int half = p.rot_dim >> 1;
  const int max_pos = p.max_pos, num_slots = p.num_slots, page_size = p.page_size;
  const int page_shift = p.page_shift;
  const bool pos64 = p.pos_is64, loc64 = p.loc_is64;
  // The launcher guarantees these alignments (16-byte pieces, 8-byte fp8 stores); checking them
  // here also makes the compiler compute the plan and read the kernel parameters before the
  // dependency wait below (ptxas would otherwise sink them after it, onto the critical path:
  // a kernel's parameters are cold in the constant cache at every launch).
  const uint64_t misaligned =
      ((reinterpret_cast<uint64_t>(src) | static_cast<uint64_t>(src_tok * sizeof(T)) |
        reinterpret_cast<uint64_t>(cos_sin) | static_cast<uint64_t>(cs_stride * 4)) & 15) |
      ((reinterpret_cast<uint64_t>(dst) | static_cast<uint64_t>(page_stride) |
        static_cast<uint64_t>(off_stride) | static_cast<uint64_t>(piece_b)) & 7) |
      ((reinterpret_cast<uint64_t>(positions) | reinterpret_cast<uint64_t>(cache_loc) |
        reinterpret_cast<uint64_t>(scale_ptr)) & 3);
  if (active && (misaligned != 0 || num_tokens < 0 || max_pos <= 0 || page_size <= 0 ||
                 host_inv != host_inv)) {
    __trap();
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch: wait for the previous kernel's results before the first
  // load, and let the next kernel start launching.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (!active) return;

  for (int64_t t = t0; t < num_tokens; t += U * step) {
    TokenLoads in[U];
    bool ok[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t tok = t + u * step;
      ok[u] = tok < num_tokens;
      if (!ok[u]) continue;
      if (rot) {
        in[u].pos = pos64 ? static_cast<const int64_t*>(positions)[tok]
                          : static_cast<const int32_t*>(positions)[tok];
      }
      if (to_cache) {
        in[u].slot = loc64 ? static_cast<const int64_t*>(cache_loc)[tok]
                           : static_cast<const int32_t*>(cache_loc)[tok];
      }
      const T* row = src + tok * src_tok;
      in[u].a = *reinterpret_cast<const uint4*>(row);
      if (rot) in[u].b = *reinterpret_cast<const uint4*>(row + piece_b);
    }
    float s = 1.f;
    if (to_cache && scale_mode == 2) s = *scale_ptr;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!ok[u]) continue;
      T* row = src + (t + u * step) * src_tok;
      uint4 wa = in[u].a, wb = in[u].b;
      if (rot) {
        const int64_t pos = min(max(in[u].pos, int64_t(0)), int64_t(max_pos - 1));
        const float* cs = cos_sin + pos * cs_stride + c;
        float cos[8], sin[8], a[8], b[8];
        load_float8(cs, cos);
        load_float8(cs + half, sin);
        if (NEOX) {
          unpack8<T>(wa, a);
          unpack8<T>(wb, b);
        } else {  // 16 adjacent dims: pair i = dims (2i, 2i + 1)
          float lo[8], hi[8];
          unpack8<T>(wa, lo);
          unpack8<T>(wb, hi);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            a[i] = lo[2 * i], b[i] = lo[2 * i + 1], a[i + 4] = hi[2 * i], b[i + 4] = hi[2 * i + 1];
          }
        }
        float oa[8], ob[8];  // memory order: neox (x | y); GPT-J interleaved (x0 y0 x1 y1 ..)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float x = a[i] * cos[i] - b[i] * sin[i];
          const float y = b[i] * cos[i] + a[i] * sin[i];
          if (NEOX) {
            oa[i] = x, ob[i] = y;
          } else {
            float* o = i < 4 ? oa : ob;
            o[2 * (i & 3)] = x, o[2 * (i & 3) + 1] = y;
          }
        }
        wa = pack8<T>(oa), wb = pack8<T>(ob);
        *reinterpret_cast<uint4*>(row) = wa;
        *reinterpret_cast<uint4*>(row + piece_b) = wb;
      }
      if (!to_cache) continue;
      const int64_t slot = in[u].slot;
      if (slot < 0 || slot >= num_slots) continue;  // skipped slots are not written
      char* out = dst + slot_offset(slot, page_size, page_shift, page_stride, off_stride);
      if (CACHE == kSame && scale_mode == 0) {
        *reinterpret_cast<uint4*>(out) = wa;
        if (rot) *reinterpret_cast<uint4*>(out + piece_b * sizeof(T)) = wb;
        continue;
      }
      // The cache holds the returned key: it was rounded to T above; scale and convert.
      const float inv = scale_mode == 2 ? __frcp_rn(s) : host_inv;
      float f[8];
      unpack8<T>(wa, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) f[i] = scale_mode ? f[i] * inv : f[i];
      store_cache8<T, CACHE>(out, f);
      if (rot) {
        unpack8<T>(wb, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = scale_mode ? f[i] * inv : f[i];
        store_cache8<T, CACHE>(out + piece_b * kCacheBytes, f);
      }
    }
  }
}

// ---------------------------------------------------------------- host side (called by ctypes)
using KernelFn = void (*)(RopeKVParams);

template <typename T, int U>
static KernelFn pick_cache(int cache, int neox) {
  switch (cache * 2 + (neox ? 1 : 0)) {
    case 0: return rope_kv_kernel<T, kSame, false, U>;
    case 1: return rope_kv_kernel<T, kSame, true, U>;
    case 2: return rope_kv_kernel<T, kE4M3, false, U>;
    case 3: return rope_kv_kernel<T, kE4M3, true, U>;
    case 4: return rope_kv_kernel<T, kE5M2, false, U>;
    case 5: return rope_kv_kernel<T, kE5M2, true, U>;
    default: return nullptr;
  }
}

// unroll: tokens whose loads a thread issues together (1 or 2).
static KernelFn pick(int is_bf16, int cache, int neox, int unroll) {
  if (unroll == 2) {
    return is_bf16 ? pick_cache<__nv_bfloat16, 2>(cache, neox) : pick_cache<__half, 2>(cache, neox);
  }
  return is_bf16 ? pick_cache<__nv_bfloat16, 1>(cache, neox) : pick_cache<__half, 1>(cache, neox);
}

static int use_device(int device) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  return static_cast<int>(err);
}

extern "C" int sgl_ext_rope_kv_struct_size() { return static_cast<int>(sizeof(RopeKVParams)); }

// Load every kernel of the library on `device` now, outside any CUDA-graph capture.
extern "C" int sgl_ext_rope_kv_preload(int device) {
  int err = use_device(device);
  for (int v = 0; v < 24 && err == 0; ++v) {
    cudaFuncAttributes attr;
    err = static_cast<int>(
        cudaFuncGetAttributes(&attr, pick((v / 6) % 2, (v / 2) % 3, v % 2, 1 + v / 12)));
  }
  return err;
}

extern "C" int sgl_ext_rope_kv_launch(const RopeKVParams* p, int is_bf16, int cache, int neox,
                                      int unroll, int grid_x, int grid_y, int block_x,
                                      int block_y, void* stream, int device, int pdl) {
  KernelFn fn = pick(is_bf16, cache, neox, unroll);
  if (fn == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  int err = use_device(device);
  if (err) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid_x, grid_y, 1);
  cfg.blockDim = dim3(block_x, block_y, 1);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, fn, *p));
}

extern "C" const char* sgl_ext_error_string(int err) {
  return cudaGetErrorString(static_cast<cudaError_t>(err));
}
