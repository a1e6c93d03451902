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

__device__ __forceinline__ void pdl_wait_and_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch: wait for the previous kernel's results before the first
  // load, and let the next kernel start its launch now (it waits for us in turn).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
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

template <typename T, int CACHE, bool NEOX>
__global__ void __launch_bounds__(1024) rope_kv_kernel(const RopeKVParams p) {
  // Lane decode (before the dependency wait: overlaps the previous kernel's tail).
  const int nr = p.rot_dim >> 4;
  const int q_lanes = p.num_q_heads * nr;
  const int k_end = q_lanes + p.num_kv_heads * nr;
  const int t_end = p.write_kv ? k_end + p.num_kv_heads * ((p.head_dim - p.rot_dim) >> 3) : k_end;
  const int v_end = p.write_kv ? t_end + p.num_kv_heads * (p.v_head_dim >> 3) : t_end;
  const int lane = blockIdx.y * blockDim.x + threadIdx.x;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int half = p.rot_dim >> 1;
  pdl_wait_and_trigger();
  if (token >= p.num_tokens || lane >= v_end) return;

  if (lane < k_end) {  // ------------------------------------------------ rotation lane
    const bool is_key = lane >= q_lanes;
    const int l = is_key ? lane - q_lanes : lane;
    int c;
    const int head = div_rem(l, nr, c);
    c *= 8;  // first pair index
    T* row = is_key ? static_cast<T*>(p.k) + token * p.k_tok + head * p.k_head
                    : static_cast<T*>(p.q) + token * p.q_tok + head * p.q_head;
    T* pa = NEOX ? row + c : row + 2 * c;
    T* pb = NEOX ? row + half + c : row + 2 * c + 8;
    int64_t pos = p.pos_is64 ? static_cast<const int64_t*>(p.positions)[token]
                             : static_cast<const int32_t*>(p.positions)[token];
    int64_t slot = -1;
    float k_s = 1.f;
    if (is_key && p.write_kv) {
      slot = p.loc_is64 ? static_cast<const int64_t*>(p.cache_loc)[token]
                        : static_cast<const int32_t*>(p.cache_loc)[token];
      if (p.k_scale_mode == 2) k_s = *p.k_scale;
    }
    const uint4 ua = *reinterpret_cast<const uint4*>(pa);
    const uint4 ub = *reinterpret_cast<const uint4*>(pb);
    pos = min(max(pos, int64_t(0)), int64_t(p.max_pos - 1));  // memory safety
    const float* cs = p.cos_sin + pos * p.cs_stride + c;
    float cos[8], sin[8], a[8], b[8], x[8], y[8];
    load_float8(cs, cos);
    load_float8(cs + half, sin);
    if (NEOX) {
      unpack8<T>(ua, a);
      unpack8<T>(ub, b);
    } else {  // 16 adjacent dims: pairs (a[i], b[i]) = dims (2i, 2i + 1)
      float lo[8], hi[8];
      unpack8<T>(ua, lo);
      unpack8<T>(ub, hi);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        a[i] = lo[2 * i], b[i] = lo[2 * i + 1], a[i + 4] = hi[2 * i], b[i + 4] = hi[2 * i + 1];
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[i] = a[i] * cos[i] - b[i] * sin[i];
      y[i] = b[i] * cos[i] + a[i] * sin[i];
    }
    float oa[8], ob[8];  // in memory order: neox (x, y); GPT-J interleaved
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (NEOX) {
        oa[i] = x[i], ob[i] = y[i];
      } else {
        float* o = i < 4 ? oa : ob;
        o[2 * (i & 3)] = x[i], o[2 * (i & 3) + 1] = y[i];
      }
    }
    const uint4 wa = pack8<T>(oa), wb = pack8<T>(ob);
    *reinterpret_cast<uint4*>(pa) = wa;
    *reinterpret_cast<uint4*>(pb) = wb;
    if (!is_key || slot < 0 || slot >= p.num_slots) return;  // skipped slots are not written
    const int64_t dst = slot_offset(slot, p.page_size, p.page_shift, p.kb_page, p.kb_off) +
                        head * p.kb_head + (pa - row);
    const int64_t dst_b = pb - pa;  // the second piece sits at the same distance in the cache
    if (CACHE == kSame && p.k_scale_mode == 0) {
      T* kb = static_cast<T*>(p.k_buf) + dst;
      *reinterpret_cast<uint4*>(kb) = wa;
      *reinterpret_cast<uint4*>(kb + dst_b) = wb;
      return;
    }
    // The cache holds the returned key: round to T first, then scale and convert.
    const float inv = p.k_scale_mode == 2 ? __frcp_rn(k_s) : p.k_inv;
    unpack8<T>(wa, oa);
    unpack8<T>(wb, ob);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (p.k_scale_mode) oa[i] *= inv, ob[i] *= inv;
    }
    using C = typename std::conditional<CACHE == kSame, T, uint8_t>::type;
    C* kb = static_cast<C*>(p.k_buf) + dst;
    store_cache8<T, CACHE>(kb, oa);
    store_cache8<T, CACHE>(kb + dst_b, ob);
    return;
  }

  // ---------------------------------------------------------------- copy lane (K tail or V)
  const bool is_tail = lane < t_end;
  int head, d;
  const T* src;
  if (is_tail) {
    const int nt = (p.head_dim - p.rot_dim) >> 3;
    head = div_rem(lane - k_end, nt, d);
    d = p.rot_dim + d * 8;
    src = static_cast<const T*>(p.k) + token * p.k_tok + head * p.k_head + d;
  } else {
    const int nv = p.v_head_dim >> 3;
    head = div_rem(lane - t_end, nv, d);
    d *= 8;
    src = static_cast<const T*>(p.v) + token * p.v_tok + head * p.v_head + d;
  }
  const int mode = is_tail ? p.k_scale_mode : p.v_scale_mode;
  const int64_t slot = p.loc_is64 ? static_cast<const int64_t*>(p.cache_loc)[token]
                                  : static_cast<const int32_t*>(p.cache_loc)[token];
  float s = 1.f;
  if (mode == 2) s = *(is_tail ? p.k_scale : p.v_scale);
  const uint4 u = *reinterpret_cast<const uint4*>(src);
  if (slot < 0 || slot >= p.num_slots) return;
  const int64_t dst =
      is_tail ? slot_offset(slot, p.page_size, p.page_shift, p.kb_page, p.kb_off) + head * p.kb_head + d
              : slot_offset(slot, p.page_size, p.page_shift, p.vb_page, p.vb_off) + head * p.vb_head + d;
  void* buf = is_tail ? p.k_buf : p.v_buf;
  if (CACHE == kSame && mode == 0) {
    *reinterpret_cast<uint4*>(static_cast<T*>(buf) + dst) = u;
    return;
  }
  const float inv = mode == 2 ? __frcp_rn(s) : (is_tail ? p.k_inv : p.v_inv);
  float f[8];
  unpack8<T>(u, f);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (mode) f[i] *= inv;
  }
  using C = typename std::conditional<CACHE == kSame, T, uint8_t>::type;
  store_cache8<T, CACHE>(static_cast<C*>(buf) + dst, f);
}

// ---------------------------------------------------------------- host side (called by ctypes)
using KernelFn = void (*)(RopeKVParams);

template <typename T>
static KernelFn pick_cache(int cache, int neox) {
  switch (cache * 2 + (neox ? 1 : 0)) {
    case 0: return rope_kv_kernel<T, kSame, false>;
    case 1: return rope_kv_kernel<T, kSame, true>;
    case 2: return rope_kv_kernel<T, kE4M3, false>;
    case 3: return rope_kv_kernel<T, kE4M3, true>;
    case 4: return rope_kv_kernel<T, kE5M2, false>;
    case 5: return rope_kv_kernel<T, kE5M2, true>;
    default: return nullptr;
  }
}

static KernelFn pick(int is_bf16, int cache, int neox) {
  return is_bf16 ? pick_cache<__nv_bfloat16>(cache, neox) : pick_cache<__half>(cache, neox);
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
  for (int v = 0; v < 12 && err == 0; ++v) {
    cudaFuncAttributes attr;
    err = static_cast<int>(cudaFuncGetAttributes(&attr, pick(v / 6, (v / 2) % 3, v % 2)));
  }
  return err;
}

extern "C" int sgl_ext_rope_kv_launch(const RopeKVParams* p, int is_bf16, int cache, int neox,
                                      int grid_x, int grid_y, int block_x, int block_y,
                                      void* stream, int device, int pdl) {
  KernelFn fn = pick(is_bf16, cache, neox);
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
