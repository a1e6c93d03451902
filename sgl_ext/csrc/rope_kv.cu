// Fused RoPE + KV-cache write, CUDA C++ (built just in time by sgl_ext/cuda/jit.py).
//
// Threads ("lanes") of one token, laid out [rotation lanes | copy lanes] over blockDim.x threads
// and gridDim.y blocks (threadIdx.y and blockIdx.x pick the token):
//   rotation lane  rotary pair chunk c (8 pairs: neox dims c..c+7 of each half; GPT-J the 16
//                  adjacent dims 2c..2c+15) of H consecutive heads of [query heads | key heads],
//                  sharing one cos/sin load; key heads also go into the cache;
//   copy lane      H consecutive 8-dim pieces of [key pass-through dims | value heads], into
//                  the cache.
// Every load of a lane is issued before its first store; arithmetic is fp32; the key is rounded
// to its dtype before it is quantised, so the cache holds exactly the key the op returns.
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

template <typename T, int CACHE, bool NEOX, int H>
__global__ void __launch_bounds__(512) rope_kv_kernel(const RopeKVParams p) {
  // ---- plan: everything that does not read memory written by the previous kernel, before
  // the dependency wait (it overlaps that kernel's tail). Rotation lanes take pair chunk c of H
  // consecutive heads of [query heads | key heads] (one cos/sin load for all H); copy lanes take
  // H consecutive 8-dim pieces of [key tails | values].
  constexpr int kCacheBytes = CACHE == kSame ? sizeof(T) : 1;
  const int nr = p.rot_dim >> 4;
  const int num_heads = p.num_q_heads + p.num_kv_heads;
  const int rot_end = (num_heads + H - 1) / H * nr;
  const int nt = (p.head_dim - p.rot_dim) >> 3, nv = p.v_head_dim >> 3;
  const int tail_pieces = p.write_kv ? p.num_kv_heads * nt : 0;
  const int pieces = p.write_kv ? tail_pieces + p.num_kv_heads * nv : 0;
  const int lanes = rot_end + (pieces + H - 1) / H;
  const int lane = blockIdx.y * blockDim.x + threadIdx.x;
  const bool rot = lane < rot_end;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const int half = p.rot_dim >> 1;
  const int piece_b = NEOX ? half : 8;  // distance of a rotation lane's second piece
  T* src[H];
  char* dst[H];
  int64_t src_tok[H];
  bool valid[H], cached[H], is_v[H];
  int c = 0;
  int rem;
  const int group = rot ? div_rem(lane, nr, rem) : 0;
  if (rot) c = rem * 8;
#pragma unroll
  for (int i = 0; i < H; ++i) {
    int head, dim;
    if (rot) {
      const int j = group * H + i;
      const bool q = j < p.num_q_heads;
      valid[i] = j < num_heads;
      cached[i] = valid[i] && !q && p.write_kv;
      is_v[i] = false;
      head = q ? j : j - p.num_q_heads;
      dim = NEOX ? c : 2 * c;
      src[i] = static_cast<T*>(q ? p.q : p.k) + head * (q ? p.q_head : p.k_head) + dim;
      src_tok[i] = q ? p.q_tok : p.k_tok;
    } else {
      const int pc = (lane - rot_end) * H + i;
      valid[i] = cached[i] = pc < pieces;
      is_v[i] = pc >= tail_pieces;
      if (!is_v[i]) {
        head = div_rem(pc, max(nt, 1), dim);
        dim = p.rot_dim + dim * 8;
      } else {
        head = div_rem(pc - tail_pieces, max(nv, 1), dim);
        dim *= 8;
      }
      src[i] = static_cast<T*>(is_v[i] ? const_cast<void*>(p.v) : p.k) +
               head * (is_v[i] ? p.v_head : p.k_head) + dim;
      src_tok[i] = is_v[i] ? p.v_tok : p.k_tok;
    }
    dst[i] = static_cast<char*>(is_v[i] ? p.v_buf : p.k_buf) +
             ((is_v[i] ? p.vb_head : p.kb_head) * head + dim) * kCacheBytes;
  }
  const int64_t kb_page = p.kb_page * kCacheBytes, kb_off = p.kb_off * kCacheBytes;
  const int64_t vb_page = p.vb_page * kCacheBytes, vb_off = p.vb_off * kCacheBytes;
  const int64_t num_tokens = p.num_tokens;
  const void* positions = p.positions;
  const void* cache_loc = p.cache_loc;
  const float* cos_sin = p.cos_sin;
  const int64_t cs_stride = p.cs_stride;
  const int max_pos = p.max_pos, num_slots = p.num_slots, page_size = p.page_size;
  const int page_shift = p.page_shift;
  const bool pos64 = p.pos_is64, loc64 = p.loc_is64;
  const int k_mode = p.k_scale_mode, v_mode = p.v_scale_mode;
  const float k_host_inv = p.k_inv, v_host_inv = p.v_inv;
  // The launcher guarantees these alignments (16-byte pieces, 8-byte fp8 stores); checking them
  // here also makes the compiler compute the plan and read the kernel parameters before the
  // dependency wait below (ptxas would otherwise sink them after it, onto the critical path:
  // a kernel's parameters are cold in the constant cache at every launch).
  uint64_t bad16 = reinterpret_cast<uint64_t>(cos_sin) | static_cast<uint64_t>(cs_stride * 4);
  uint64_t bad8 = static_cast<uint64_t>(kb_page | kb_off | vb_page | vb_off | piece_b);
#pragma unroll
  for (int i = 0; i < H; ++i) {
    bad16 |= reinterpret_cast<uint64_t>(src[i]) | static_cast<uint64_t>(src_tok[i] * sizeof(T));
    bad8 |= reinterpret_cast<uint64_t>(dst[i]);
  }
  const uint64_t bad4 = reinterpret_cast<uint64_t>(positions) |
                        reinterpret_cast<uint64_t>(cache_loc) |
                        reinterpret_cast<uint64_t>(p.k_scale) | reinterpret_cast<uint64_t>(p.v_scale);
  const bool active = lane < lanes && token < num_tokens;
  if (active && ((bad16 & 15) | (bad8 & 7) | (bad4 & 3) || max_pos <= 0 || page_size <= 0 ||
                 k_host_inv != k_host_inv || v_host_inv != v_host_inv)) {
    __trap();
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch: wait for the previous kernel's results before the first
  // load, and let the next kernel start launching.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  if (!active) return;

  // ---- loads: position, slot, every piece, scales; then the cos/sin row (needs the position).
  int64_t pos = 0, slot = -1;
  if (rot) {
    pos = pos64 ? static_cast<const int64_t*>(positions)[token]
                : static_cast<const int32_t*>(positions)[token];
  }
  bool any_cached = false;
#pragma unroll
  for (int i = 0; i < H; ++i) any_cached |= cached[i];
  if (any_cached) {
    slot = loc64 ? static_cast<const int64_t*>(cache_loc)[token]
                 : static_cast<const int32_t*>(cache_loc)[token];
  }
  uint4 a[H], b[H];
#pragma unroll
  for (int i = 0; i < H; ++i) {
    if (!valid[i]) continue;
    const T* row = src[i] + token * src_tok[i];
    a[i] = *reinterpret_cast<const uint4*>(row);
    if (rot) b[i] = *reinterpret_cast<const uint4*>(row + piece_b);
  }
  float k_s = 1.f, v_s = 1.f;
  if (k_mode == 2 && any_cached) k_s = *p.k_scale;
  if (v_mode == 2 && !rot && any_cached) v_s = *p.v_scale;
  const bool write = slot >= 0 && slot < num_slots;  // other slots are skipped, never written
  if (rot) {
    const int64_t row = min(max(pos, int64_t(0)), int64_t(max_pos - 1));
    const float* cs = cos_sin + row * cs_stride + c;
    float cos[8], sin[8];
    load_float8(cs, cos);
    load_float8(cs + half, sin);
    const float inv = k_mode == 2 ? __frcp_rn(k_s) : k_host_inv;
#pragma unroll
    for (int i = 0; i < H; ++i) {
      if (!valid[i]) continue;
      float x[8], y[8];
      if (NEOX) {
        unpack8<T>(a[i], x);
        unpack8<T>(b[i], y);
      } else {  // 16 adjacent dims: pair k = dims (2k, 2k + 1)
        float lo[8], hi[8];
        unpack8<T>(a[i], lo);
        unpack8<T>(b[i], hi);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          x[k] = lo[2 * k], y[k] = lo[2 * k + 1], x[k + 4] = hi[2 * k], y[k + 4] = hi[2 * k + 1];
        }
      }
      float oa[8], ob[8];  // memory order: neox (x | y); GPT-J interleaved (x0 y0 x1 y1 ..)
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const float rx = x[k] * cos[k] - y[k] * sin[k];
        const float ry = y[k] * cos[k] + x[k] * sin[k];
        if (NEOX) {
          oa[k] = rx, ob[k] = ry;
        } else {
          float* o = k < 4 ? oa : ob;
          o[2 * (k & 3)] = rx, o[2 * (k & 3) + 1] = ry;
        }
      }
      const uint4 wa = pack8<T>(oa), wb = pack8<T>(ob);
      T* row = src[i] + token * src_tok[i];
      *reinterpret_cast<uint4*>(row) = wa;
      *reinterpret_cast<uint4*>(row + piece_b) = wb;
      if (!cached[i] || !write) continue;
      char* out = dst[i] + slot_offset(slot, page_size, page_shift, kb_page, kb_off);
      if (CACHE == kSame && k_mode == 0) {
        *reinterpret_cast<uint4*>(out) = wa;
        *reinterpret_cast<uint4*>(out + piece_b * kCacheBytes) = wb;
        continue;
      }
      // The cache holds the returned key: rounded to T above, then scaled and converted.
      float f[8];
      unpack8<T>(wa, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = k_mode ? f[k] * inv : f[k];
      store_cache8<T, CACHE>(out, f);
      unpack8<T>(wb, f);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = k_mode ? f[k] * inv : f[k];
      store_cache8<T, CACHE>(out + piece_b * kCacheBytes, f);
    }
    return;
  }
  if (!write) return;
  const float k_inv = k_mode == 2 ? __frcp_rn(k_s) : k_host_inv;
  const float v_inv = v_mode == 2 ? __frcp_rn(v_s) : v_host_inv;
  const int64_t k_at = slot_offset(slot, page_size, page_shift, kb_page, kb_off);
  const int64_t v_at = slot_offset(slot, page_size, page_shift, vb_page, vb_off);
#pragma unroll
  for (int i = 0; i < H; ++i) {
    if (!valid[i]) continue;
    char* out = dst[i] + (is_v[i] ? v_at : k_at);
    const int mode = is_v[i] ? v_mode : k_mode;
    if (CACHE == kSame && mode == 0) {
      *reinterpret_cast<uint4*>(out) = a[i];
      continue;
    }
    const float inv = is_v[i] ? v_inv : k_inv;
    float f[8];
    unpack8<T>(a[i], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = mode ? f[k] * inv : f[k];
    store_cache8<T, CACHE>(out, f);
  }
}

// ---------------------------------------------------------------- host side (called by ctypes)
using KernelFn = void (*)(RopeKVParams);

template <typename T, int H>
static KernelFn pick_cache(int cache, int neox) {
  switch (cache * 2 + (neox ? 1 : 0)) {
    case 0: return rope_kv_kernel<T, kSame, false, H>;
    case 1: return rope_kv_kernel<T, kSame, true, H>;
    case 2: return rope_kv_kernel<T, kE4M3, false, H>;
    case 3: return rope_kv_kernel<T, kE4M3, true, H>;
    case 4: return rope_kv_kernel<T, kE5M2, false, H>;
    case 5: return rope_kv_kernel<T, kE5M2, true, H>;
    default: return nullptr;
  }
}

// heads: heads (rotation lanes) or pieces (copy lanes) per thread, 1 or 4.
static KernelFn pick(int is_bf16, int cache, int neox, int heads) {
  if (heads == 4) {
    return is_bf16 ? pick_cache<__nv_bfloat16, 4>(cache, neox) : pick_cache<__half, 4>(cache, neox);
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
        cudaFuncGetAttributes(&attr, pick((v / 6) % 2, (v / 2) % 3, v % 2, v < 12 ? 1 : 4)));
  }
  return err;
}

extern "C" int sgl_ext_rope_kv_launch(const RopeKVParams* p, int is_bf16, int cache, int neox,
                                      int heads, int grid_x, int grid_y, int block_x,
                                      int block_y, void* stream, int device, int pdl) {
  KernelFn fn = pick(is_bf16, cache, neox, heads);
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
