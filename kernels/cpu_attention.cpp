// Paged attention for the CPU: one pass over each row's visible keys with an online softmax.
//
// Built at run time by kernels/cpu_attention_build.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes by kernels/cpu_attention.py, which documents the contract. Plain C++ loops that
// the compiler vectorises for whatever ISA the machine has, and SIMD block loops (block_scores,
// block_values below) for head dims of 16s with AVX-512 (VNNI for int8 keys), or of 8s with AVX2
// (vpmaddwd for int8 keys at head dims of 16s).
//
// The cache holds the query's dtype, or quantized rows (kernels/kv_quant.py): int8 or fp8 e4m3
// codes, then the row's float32 scale. Reading one costs a code widened to float per element and
// one multiply per (key, head) by its scale, folded into the score (keys) and the softmax weight
// (values); the loops stay the same loops, over half the bytes or fewer.
//
// Why a hand-written loop: Inductor's version of the same maths (kernels/inline_attention.py)
// reduces over the head dimension once per key and runs the softmax as separate passes over the
// scores; this kernel reads each key and value once, keeps the running max, sum and output of
// every query head of a KV-head group in registers/L1, and never touches a masked slot (so NaN or
// inf left in unused cache slots cannot reach a result, with no mask at all).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_exp.h"  // exp_nonpositive, exp_nonpositive8, exp_nonpositive16

// The library is built with -march=native, so these compile-time checks are the machine's.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define CE_ATTENTION_AVX512 1
#define CE_ATTENTION_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CE_ATTENTION_AVX2 1
#define CE_ATTENTION_SIMD 1
#endif
// int8 values in integer maths: span_values_vnni (AVX-512 VNNI) or span_values_madd (AVX2).
#if defined(CE_ATTENTION_AVX2) || (defined(CE_ATTENTION_AVX512) && defined(__AVX512VNNI__))
#define CE_ATTENTION_INT_VALUES 1
#endif

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {  // bfloat16 -> float: the high half of the bits
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float load(const _Float16* p, int64_t i) { return static_cast<float>(p[i]); }

// Quantized caches' codes (kernels/kv_quant.py): the code's value, which the row's scale multiplies.
inline float load(const int8_t* p, int64_t i) { return static_cast<float>(p[i]); }

// fp8 e4m3 (bias 7) -> float, as the code's value / 256: the sign, exponent and mantissa bits moved
// into a float16 (bias 15) keep the value scaled by 2^(7 - 15), subnormals included, and float16
// widens in hardware where the CPU has F16C. Callers fold the 256 into the row's scale.
constexpr float kFp8Unit = 256.0f;

inline float load(const uint8_t* p, int64_t i) {
  const uint16_t bits = static_cast<uint16_t>(((p[i] & 0x7fu) << 7) | ((p[i] & 0x80u) << 8));
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}

// What one unit of load()'s result is worth before the row's scale: 1 for int8, 256 for fp8.
template <typename C>
constexpr float code_unit() { return std::is_same_v<C, uint8_t> ? kFp8Unit : 1.0f; }

// Plain caches hold the query's dtype; int8_t and uint8_t (fp8 e4m3 bits) caches are quantized.
template <typename T, typename C>
constexpr bool quantized() { return !std::is_same_v<T, C>; }

// float -> fp8 e4m3 bits, rounded to nearest even, for |x| <= 448 (kernels/kv_quant.py clamps):
// the same rounding as torch's float8_e4m3fn conversion, so both write the same codes.
inline uint8_t encode_fp8(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  bits &= 0x7fffffffu;
  float magnitude;
  std::memcpy(&magnitude, &bits, sizeof magnitude);
  if (magnitude < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 steps is the first normal)
    return sign | static_cast<uint8_t>(std::nearbyint(magnitude * 512.0f));
  }
  bits += 0x7ffffu + ((bits >> 20) & 1u);  // round the mantissa to 3 bits, ties to even
  return sign | static_cast<uint8_t>((bits >> 20) - (120u << 3));  // rebias the exponent 127 -> 7
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }

inline void store(_Float16* p, int64_t i, float v) { p[i] = static_cast<_Float16>(v); }

inline void store(uint16_t* p, int64_t i, float v) {  // float -> bfloat16, round to nearest even
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN (quiet)
    p[i] = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__)
// The first min(count, 16) lanes of a 16-lane mask (the masked loads and stores of a short tail).
inline __mmask16 first_lanes(int64_t count) {
  return static_cast<__mmask16>(count >= 16 ? 0xffffu : (1u << count) - 1u);
}
#endif

// exp(x) for x <= 0 (one value; 16 lanes with AVX-512, 8 with AVX2): kernels/cpu_exp.h.
using ce_exp::exp_nonpositive;
#if defined(__AVX512F__)
using ce_exp::exp_nonpositive16;
#elif defined(CE_ATTENTION_AVX2)
using ce_exp::exp_nonpositive8;
#endif

#ifdef CE_ATTENTION_SIMD
// One register of float lanes (`Vec`, kLanes wide) and the few operations the loops below use,
// for AVX-512 (16 lanes) or AVX2 (8), so the block loops are written once. GCC left the widening
// of int8 and fp8 codes partly scalar and reduced each dot lane by lane; here a register of
// values is widened in a few instructions and each dot ends in one tree reduction. Elsewhere:
// the plain loops below.
#ifdef CE_ATTENTION_AVX512
using Vec = __m512;
constexpr int kLanes = 16;
inline Vec v_zero() { return _mm512_setzero_ps(); }
inline Vec v_load(const float* p) { return _mm512_loadu_ps(p); }
inline void v_store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec v_set1(float x) { return _mm512_set1_ps(x); }
inline Vec v_mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec v_fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float v_sum(Vec v) { return _mm512_reduce_add_ps(v); }
// The first m lanes of v to p (m <= kLanes).
inline void v_store_first(float* p, Vec v, int64_t m) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << m) - 1u), v);
}

inline Vec widen(const float* p) { return _mm512_loadu_ps(p); }
inline Vec widen(const uint16_t* p) {  // bfloat16: the high half of a float's bits
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline Vec widen(const _Float16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline Vec widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec widen(const uint8_t* p) {  // fp8 e4m3 -> float16 bits (load()'s trick) -> float
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7),
                                       _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(half);
}

// Lane j of the result = the sum of v[j]'s 16 lanes: a transpose-add tree, ~3 instructions a dot
// where a reduction each takes ~8.
inline Vec reduce_lanes(const Vec* v) {
  __m512 c[8], d[4], e[2];
  for (int k = 0; k < 8; ++k)  // 512 -> 256: v[2k]'s 8 partials in the low half, v[2k + 1]'s high
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lane L: 4 partials of slot 4k + L
    d[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // lane L: 2 partials each of slots 8k + L and 8k + 4 + L
    e[k] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * k], d[2 * k + 1]), _mm512_unpackhi_ps(d[2 * k], d[2 * k + 1]));
  const __m512d e0 = _mm512_castps_pd(e[0]), e1 = _mm512_castps_pd(e[1]);
  // Lane L: slots L, 4 + L, 8 + L, 12 + L; then into slot order.
  const __m512 f = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e0, e1)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(e0, e1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, f);
}
#else  // AVX2 + FMA + F16C
using Vec = __m256;
constexpr int kLanes = 8;
inline Vec v_zero() { return _mm256_setzero_ps(); }
inline Vec v_load(const float* p) { return _mm256_loadu_ps(p); }
inline void v_store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec v_set1(float x) { return _mm256_set1_ps(x); }
inline Vec v_mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec v_fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float v_sum(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float v_max(Vec v) {  // a NaN lane may or may not win: callers have none, or check apart
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
inline void v_store_first(float* p, Vec v, int64_t m) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  for (int64_t j = 0; j < m; ++j) p[j] = lanes[j];
}

inline Vec widen(const float* p) { return _mm256_loadu_ps(p); }
inline Vec widen(const uint16_t* p) {  // bfloat16: the high half of a float's bits
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline Vec widen(const _Float16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Vec widen(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec widen(const uint8_t* p) {  // fp8 e4m3 -> float16 bits (load()'s trick) -> float
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7),
                                    _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(half);
}

// Lane j of the result = the sum of v[j]'s 8 lanes: two rounds of pairwise adds, then the two
// 128-bit halves of the partial sums added together.
inline Vec reduce_lanes(const Vec* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif
#endif

// sum_d q[d] * load(row, d): over D values, or kHeadDim when it is a compile-time head dim.
template <typename C, int kHeadDim>
inline float dot_row(const float* q, const C* row, int64_t D) {
#ifdef CE_ATTENTION_SIMD
  if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
    Vec acc = v_zero();
    for (int64_t d = 0; d < kHeadDim; d += kLanes) acc = v_fmadd(v_load(q + d), widen(row + d), acc);
    return v_sum(acc);
  }
#endif
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += q[d] * load(row, d);
  return s;
}

// acc[d] += w * load(row, d).
template <typename C, int kHeadDim>
inline void axpy_row(float* acc, float w, const C* row, int64_t D) {
#ifdef CE_ATTENTION_SIMD
  if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
    const Vec weight = v_set1(w);
    for (int64_t d = 0; d < kHeadDim; d += kLanes) v_store(acc + d, v_fmadd(weight, widen(row + d), v_load(acc + d)));
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] += w * load(row, d);
}

constexpr int64_t kAhead = 2;  // prefetch distance, in blocks
constexpr int64_t kSpan = 4;  // blocks per online-softmax update (attend_rows)

// int16 weights a query vector's span takes in the integer value loops' layout (span_values_vnni,
// span_values_madd: each block padded to an even count), rounded up to even so every vector's
// pairs start 4-byte aligned.
inline int64_t weight_pairs_stride(int64_t block_size) { return (kSpan * (block_size + 1) + 1) / 2 * 2; }

// The integer value loops' int32 sums are exact while a span holds at most this many key pairs
// (kMaxWeightPairs * 2 * 32767 * 128 < 2^31; span_values_vnni has the scheme).
constexpr int64_t kMaxWeightPairs = 256;

// kLocality: __builtin_prefetch's (1: into the outer caches; 3: into L1 as well).
template <int kLocality>
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, kLocality);
}

inline int64_t read_index(const void* p, bool is64, int64_t i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<const int32_t*>(p)[i];
}

struct Problem {
  const void* query;  // [T, Hq, D], rows q_stride_t apart, heads q_stride_h apart
  int64_t q_stride_t, q_stride_h;
  const void* key;  // this step's [T, Hkv, D] keys and values, to write into the cache first
  int64_t k_stride_t, k_stride_h;
  const void* value;
  int64_t v_stride_t, v_stride_h;
  void* key_cache;  // element (block, slot, head, d) at block*stride_block + slot*stride_slot + head*stride_head + d
  void* value_cache;
  int64_t stride_block, stride_slot, stride_head;
  int64_t scale_offset;  // quantized caches: bytes from a row's start to its float32 scale
  const void* slot_mapping;  // [T]; -1: padding, written to the scratch block (the cache's last)
  bool slots64;
  const void* block_tables;  // [S, W], rows bt_stride apart
  int64_t bt_stride;
  bool bt64;
  const void* seq_lens;  // [S]
  bool sl64;
  const void* query_start_loc;  // [S + 1]
  bool qsl64;
  void* out;  // [T, Hq, D] contiguous
  int64_t num_tokens, num_seqs, width, num_blocks, block_size, num_q_heads, num_kv_heads, head_dim;
  int64_t sliding_window;  // <= 0: none
  float scale;
  float softcap;  // <= 0: none
};

// One head's D values quantized into a packed row: codes, then the float32 scale at scale_offset,
// with kernels/kv_quant.py's maths step for step (amax / QMAX, x / scale, round to nearest even).
template <typename T, typename C>
void quantize_row(const T* x, C* row, int64_t head_dim, int64_t scale_offset) {
  constexpr float qmax = std::is_same_v<C, int8_t> ? 127.0f : 448.0f;
  float amax = 0.0f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(load(x, d)));
  const float scale = std::max(amax / qmax, std::numeric_limits<float>::min());
  for (int64_t d = 0; d < head_dim; ++d) {
    const float scaled = std::min(std::max(load(x, d) / scale, -qmax), qmax);
    if constexpr (std::is_same_v<C, int8_t>) {
      row[d] = static_cast<int8_t>(std::nearbyint(scaled));
    } else {
      row[d] = encode_fp8(scaled);
    }
  }
  for (int64_t d = head_dim; d < scale_offset; ++d) row[d] = 0;  // the padding before the scale
  std::memcpy(reinterpret_cast<char*>(row) + scale_offset, &scale, sizeof scale);
}

// A quantized row's scale times what one unit of its codes is worth.
template <typename C>
inline float row_scale(const C* row, int64_t scale_offset) {
  float scale;
  std::memcpy(&scale, reinterpret_cast<const char*>(row) + scale_offset, sizeof scale);
  return scale * code_unit<C>();
}

#ifdef CE_ATTENTION_SIMD
// One block's keys and values for the query heads of one KV head, kLanes slots at a time: each
// row is widened once for all the group's query heads (not once per query head), and the kLanes
// dots of a head end in one transpose-add tree (`reduce_lanes`). On a quantized cache the
// per-element work is what bounds the read, not the bytes (int8 rows are half of bf16's), so this
// is where an int8 cache gains its speed.
// Query vectors per KV head the fast path keeps partial dots for: a KV head's query heads, times
// the rows of one sequence that attend together (attend_rows).
constexpr int64_t kFastGroup = 16;

// scores[g * bs + j] = q_g . row_j (times row_j's scale when quantized) for j < n, g < group.
template <typename C, int kHeadDim, bool kQuantized>
void block_scores(const float* q, int64_t group, const C* first_row, int64_t stride_slot, int64_t n,
                  int64_t scale_offset, float* scores, int64_t bs) {
  constexpr int kChunks = kHeadDim / kLanes;
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - j0);
    Vec part[kFastGroup][kLanes];
    alignas(64) float key_scale[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j >= m) {
        for (int64_t g = 0; g < group; ++g) part[g][j] = v_zero();
        key_scale[j] = 0.0f;
        continue;
      }
      const C* row = first_row + (j0 + j) * stride_slot;
      Vec w[kChunks];
      for (int c = 0; c < kChunks; ++c) w[c] = widen(row + kLanes * c);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * kHeadDim;
        Vec sum = v_mul(v_load(qg), w[0]);
        for (int c = 1; c < kChunks; ++c) sum = v_fmadd(v_load(qg + kLanes * c), w[c], sum);
        part[g][j] = sum;
      }
      if constexpr (kQuantized) key_scale[j] = row_scale(row, scale_offset);
    }
    for (int64_t g = 0; g < group; ++g) {
      Vec s = reduce_lanes(part[g]);
      if constexpr (kQuantized) s = v_mul(s, v_load(key_scale));
      v_store_first(scores + g * bs + j0, s, m);
    }
  }
}
#endif

// The scale of a query head's 16-bit form for the integer key loops (AVX2's block_scores_madd,
// AVX-512's block_scores_vnni): q16 = round(q / scale) with scale = max|q| / 32767. NaN where q
// holds a NaN or an infinity (no 16-bit form): every score, weight and output of that query is then
// NaN, as the reference gives.
template <int kHeadDim>
inline float query_int16_scale(const float* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int d = 0; d < kHeadDim; ++d) {
    amax = std::max(amax, std::fabs(q[d]));
    finite = finite && std::isfinite(q[d]);
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  return amax > 0.0f ? amax / 32767.0f : 1.0f;
}

#if defined(CE_ATTENTION_AVX2)
// int8 keys against a bf16 / fp16 query on AVX2, in integer maths with vpmaddwd: the query rounded
// to 16 bits per head as the VNNI path below does (q16 = round(q / qscale), qscale = max|q| / 32767,
// as fine as the bf16 / fp16 query it came from), each key's codes
// widened to int16 once for all of the group's query vectors, two products summed into each of 8
// int32 lanes an instruction. The float loop (block_scores) widened every code to float in two
// instructions per 8 and spent an FMA per 8 codes and query vector; this spends one widening per 16
// codes and a multiply-add and an add per 16 codes and query vector. Each lane's sum is exact in
// int32 (|sum| <= 2 * 32767 * 127 * kHeadDim / 16) and converted to float before the same
// transpose-add tree.

// One query head's q16 at dst (kHeadDim int16) and its scale (query_int16_scale's); q is float
// [kHeadDim]. A non-finite query gets zeros and the NaN scale.
template <int kHeadDim>
inline void quantize_query_int16(const float* q, int16_t* dst, float* qscale) {
  const float scale = query_int16_scale<kHeadDim>(q);
  *qscale = scale;
  if (std::isnan(scale)) {
    std::memset(dst, 0, sizeof(int16_t) * kHeadDim);
    return;
  }
  const float inv = 1.0f / scale;
  for (int d = 0; d < kHeadDim; ++d) dst[d] = static_cast<int16_t>(std::nearbyint(q[d] * inv));
}

// scores[g * bs + j] = q_g . row_j * row_j's scale for j < n, g < group (q16: quantize_query_int16's,
// kHeadDim int16 a head).
template <int kHeadDim>
void block_scores_madd(const int16_t* q16, const float* qscale, int64_t group, const int8_t* first_row,
                       int64_t stride_slot, int64_t n, int64_t scale_offset, float* scores, int64_t bs) {
  constexpr int kChunks = kHeadDim / 16;
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, n - j0);
    Vec part[kFastGroup][kLanes];
    alignas(32) float key_scale[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) {
      if (j >= m) {
        for (int64_t g = 0; g < group; ++g) part[g][j] = v_zero();
        key_scale[j] = 0.0f;
        continue;
      }
      const int8_t* row = first_row + (j0 + j) * stride_slot;
      __m256i k[kChunks];
      for (int c = 0; c < kChunks; ++c)
        k[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * c)));
      for (int64_t g = 0; g < group; ++g) {
        const int16_t* qg = q16 + g * kHeadDim;
        __m256i sum = _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg)), k[0]);
        for (int c = 1; c < kChunks; ++c)
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 16 * c)), k[c]));
        part[g][j] = _mm256_cvtepi32_ps(sum);
      }
      key_scale[j] = row_scale(row, scale_offset);
    }
    const Vec ks = v_load(key_scale);
    for (int64_t g = 0; g < group; ++g)
      v_store_first(scores + g * bs + j0, v_mul(v_mul(reduce_lanes(part[g]), ks), v_set1(qscale[g])), m);
  }
}

// int8 values against the softmax weights of a bf16 / fp16 query on AVX2, in integer maths with
// vpmaddwd: span_values_vnni's scheme below (two keys' codes sign-extended to int16 and
// interleaved, a broadcast pair of the two keys' 16-bit weights, exact int32 sums scaled into the
// float accumulators once per span), with a multiply-add and an add where VNNI has one
// instruction. The float loop (block_values) keeps a whole 64-dim head's accumulators in half the
// 16 registers, so it runs one query vector at a time and widens every code to float once per
// vector, then spends an FMA per 8 codes and vector: ~27 instructions a key and vector. Here 32
// dims at a time for two vectors: ~13.

// span_scale_factors and span_weights_vnni as span_values_vnni has them, in 8-lane vectors.
inline bool span_scale_factors(const int8_t* const* first_row, const int64_t* span_len, int64_t num_blocks,
                               int64_t stride_slot, int64_t scale_offset, float* factor, float* unit) {
  int64_t n = 0;  // the span's keys
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int8_t* at = first_row[b] + scale_offset;
    for (int64_t j = 0; j < span_len[b]; ++j) std::memcpy(factor + n++, at + j * stride_slot, sizeof(float));
  }
  __m256 top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 scale = _mm256_loadu_ps(factor + j);
    top = _mm256_max_ps(top, scale);
    total = _mm256_add_ps(total, scale);  // NaN and infinity stick in a sum of positive scales
  }
  float smax = v_max(top);
  float sum = v_sum(total);
  for (; j < n; ++j) {
    smax = std::max(smax, factor[j]);
    sum += factor[j];
  }
  if (!(sum <= std::numeric_limits<float>::max()) || !(smax > 0.0f)) return false;
  const float inv = 32767.0f / smax;
  for (j = 0; j + 8 <= n; j += 8)
    _mm256_storeu_ps(factor + j, _mm256_mul_ps(_mm256_loadu_ps(factor + j), _mm256_set1_ps(inv)));
  for (; j < n; ++j) factor[j] *= inv;
  *unit = smax / 32767.0f;
  return true;
}

inline void span_weights_vnni(const float* weights, int64_t sbs, int64_t group, const float* factor,
                              const int64_t* span_len, int64_t num_blocks, int16_t* w16, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* wg = weights + g * sbs;
    int16_t* out = w16 + g * stride;
    for (int64_t b = 0, offset = 0, at = 0; b < num_blocks; ++b) {
      const int64_t m = span_len[b];
      int64_t j = 0;
      for (; j + 8 <= m; j += 8) {
        const __m256i w = _mm256_cvtps_epi32(
            _mm256_mul_ps(_mm256_loadu_ps(wg + offset + j), _mm256_loadu_ps(factor + offset + j)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + at + j),
                         _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
      }
      // The same rounding as cvtps (the current mode: to nearest even).
      for (; j < m; ++j) out[at + j] = static_cast<int16_t>(std::nearbyint(wg[offset + j] * factor[offset + j]));
      if (m & 1) out[at + m] = 0;
      offset += m;
      at += m + (m & 1);
    }
  }
}

// acc[g * kHeadDim + dim0 + d] += unit * sum_j w16[g][j] * row_j[dim0 + d] for d < 32, over the
// span's blocks, for kGroup query vectors: 4 int32 registers a vector.
template <int kHeadDim, int kGroup>
void span_values_madd_fixed(float* acc, const int16_t* w16, int64_t stride, float unit,
                            const int8_t* const* first_row, const int64_t* span_len, int64_t num_blocks,
                            int64_t stride_slot, int64_t dim0) {
  __m256i sums[kGroup][4];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < 4; ++c) sums[g][c] = _mm256_setzero_si256();
  for (int64_t b = 0, at = 0; b < num_blocks; ++b) {
    const int64_t m = span_len[b];
    for (int64_t j = 0; j < m; j += 2, ++at) {
      const int8_t* r0 = first_row[b] + j * stride_slot + dim0;
      const int8_t* r1 = j + 1 < m ? r0 + stride_slot : r0;  // weight 0 past the block's end
      __m256i w[kGroup];
      for (int g = 0; g < kGroup; ++g) {
        int32_t pair;  // the two keys' 16-bit weights (memcpy: int16 storage read as one int32)
        std::memcpy(&pair, w16 + g * stride + 2 * at, sizeof pair);
        w[g] = _mm256_set1_epi32(pair);
      }
      for (int c = 0; c < 2; ++c) {  // 16 dims a chunk
        const __m256i x0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 16 * c)));
        const __m256i x1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + 16 * c)));
        const __m256i lo = _mm256_unpacklo_epi16(x0, x1);  // 128-bit lane L: dims 8L .. 8L + 3 of the chunk
        const __m256i hi = _mm256_unpackhi_epi16(x0, x1);  // dims 8L + 4 .. 8L + 7
        for (int g = 0; g < kGroup; ++g) {
          sums[g][2 * c] = _mm256_add_epi32(sums[g][2 * c], _mm256_madd_epi16(lo, w[g]));
          sums[g][2 * c + 1] = _mm256_add_epi32(sums[g][2 * c + 1], _mm256_madd_epi16(hi, w[g]));
        }
      }
    }
  }
  // Back into dim order: a chunk's dims 0-7 are lo's and hi's low lanes, 8-15 their high lanes.
  const __m256 u = _mm256_set1_ps(unit);
  for (int g = 0; g < kGroup; ++g) {
    float* a = acc + g * kHeadDim + dim0;
    for (int c = 0; c < 2; ++c) {
      const __m256 lo = _mm256_cvtepi32_ps(sums[g][2 * c]), hi = _mm256_cvtepi32_ps(sums[g][2 * c + 1]);
      _mm256_storeu_ps(a + 16 * c,
                       _mm256_fmadd_ps(_mm256_permute2f128_ps(lo, hi, 0x20), u, _mm256_loadu_ps(a + 16 * c)));
      _mm256_storeu_ps(a + 16 * c + 8,
                       _mm256_fmadd_ps(_mm256_permute2f128_ps(lo, hi, 0x31), u, _mm256_loadu_ps(a + 16 * c + 8)));
    }
  }
}

// span_values_madd_fixed over `group` query vectors, two at a time, 32 dims at a time.
template <int kHeadDim>
void span_values_madd(float* acc, int64_t group, const int16_t* w16, int64_t stride, float unit,
                      const int8_t* const* first_row, const int64_t* span_len, int64_t num_blocks,
                      int64_t stride_slot) {
  for (int64_t g = 0; g < group;) {
    float* a = acc + g * kHeadDim;
    const int16_t* w = w16 + g * stride;
    const bool two = group - g >= 2;
    for (int64_t dim0 = 0; dim0 < kHeadDim; dim0 += 32) {
      if (two) {
        span_values_madd_fixed<kHeadDim, 2>(a, w, stride, unit, first_row, span_len, num_blocks, stride_slot, dim0);
      } else {
        span_values_madd_fixed<kHeadDim, 1>(a, w, stride, unit, first_row, span_len, num_blocks, stride_slot, dim0);
      }
    }
    g += two ? 2 : 1;
  }
}
#endif

#if defined(CE_ATTENTION_AVX512) && defined(__AVX512VNNI__)
// int8 keys against a bf16 / fp16 query on AVX-512 VNNI, in integer maths with vpdpbusd (64
// unsigned x signed byte products summed four by four into 16 int32 lanes, one instruction), so a
// cached key code is never widened. The query is rounded to 16 bits per head, q16 = round(q /
// qscale) with qscale = max|q| / 32767 (as fine as the bf16 / fp16 query it came from, as the int16
// loop this replaced did), and split into bytes, q16 = 256 qhi + qlo
// (qhi signed, qlo unsigned). Then q16 . k = 256 (k + 128) . qhi - 256 * 128 * sum(qhi) + qlo . k:
// the key's codes with their top bit flipped (k + 128, unsigned) meet the signed high bytes, the
// codes as they are meet the unsigned low bytes; all exact in int32 (|256 (k + 128) . qhi| <=
// 2^8 * 255 * 128 * 128 < 2^31 at head dims up to 128). Two keys share a register, the first's
// 32-code halves in the low 256 bits and the second's in the high, so each pair ends as one
// register of 8 + 8 partial sums and 16 keys' dots need only the last three rounds of
// reduce_lanes' transpose-add tree. (The same idea for the values -- four rows' codes interleaved
// byte by byte against four softmax weights rounded to 16 bits -- measured slower than the float
// loop on an AMD Zen 5 and is not used.)
constexpr int kInt8QueryBytes = 4;  // per head dim value: qhi and qlo, each stored twice (both halves)

// One query head's bytes for block_scores_vnni at dst ([hi pairs | lo pairs], 2 * 2 * D bytes), the
// int32 correction 256 * 128 * sum(qhi) and the scale; q is float [D]. A query holding a NaN or an
// infinity gets a NaN scale, so its scores, weights and output are NaN, as the reference gives.
template <int kHeadDim>
inline void quantize_query_vnni(const float* q, int8_t* dst, int32_t* correction, float* qscale) {
  const float scale = query_int16_scale<kHeadDim>(q);
  if (std::isnan(scale)) {  // no 16-bit form: zero bytes and the NaN scale
    std::memset(dst, 0, kInt8QueryBytes * kHeadDim);
    *correction = 0;
    *qscale = scale;
    return;
  }
  const float inv = 1.0f / scale;
  int8_t* hi = dst;
  uint8_t* lo = reinterpret_cast<uint8_t*>(dst + 2 * kHeadDim);
  int32_t sum_hi = 0;
  for (int d = 0; d < kHeadDim; ++d) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(q[d] * inv));  // |v| <= 32767
    const int32_t h = v >> 8;                                             // floor(v / 256): -128..127
    const int32_t l = v - 256 * h;                                        // 0..255
    const int c = d / 32, i = d % 32;  // chunk c's 32 bytes, twice: [chunk | chunk]
    hi[64 * c + i] = hi[64 * c + 32 + i] = static_cast<int8_t>(h);
    lo[64 * c + i] = lo[64 * c + 32 + i] = static_cast<uint8_t>(l);
    sum_hi += h;
  }
  *correction = 256 * 128 * sum_hi;
  *qscale = scale;
}

// c[k]: the partial sums of keys 2k (low 8 lanes) and 2k + 1 (high 8); lane j of the result: key j's
// dot. reduce_lanes' rounds after its first, in int32.
inline __m512i reduce_pairs(const __m512i* c) {
  __m512i d[4], e[2];
  for (int k = 0; k < 4; ++k)
    d[k] = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2 * k], c[2 * k + 1], 0x88),
                            _mm512_shuffle_i32x4(c[2 * k], c[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    e[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2 * k], d[2 * k + 1]), _mm512_unpackhi_epi32(d[2 * k], d[2 * k + 1]));
  const __m512i f = _mm512_add_epi32(_mm512_unpacklo_epi64(e[0], e[1]), _mm512_unpackhi_epi64(e[0], e[1]));
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

// scores[g * bs + j] = q_g . row_j * row_j's scale for j < n, g < group (qbytes: quantize_query_vnni's,
// 4 * kHeadDim bytes a head).
template <int kHeadDim>
void block_scores_vnni(const int8_t* qbytes, const int32_t* correction, const float* qscale, int64_t group,
                       const int8_t* first_row, int64_t stride_slot, int64_t n, int64_t scale_offset, float* scores,
                       int64_t bs) {
  constexpr int kChunks = kHeadDim / 32;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    __m512i part[kFastGroup][8];
    alignas(64) float key_scale[16];
    for (int64_t p = 0; p < 8; ++p) {
      if (2 * p >= m) {
        for (int64_t g = 0; g < group; ++g) part[g][p] = _mm512_setzero_si512();
        continue;
      }
      const int8_t* r0 = first_row + (j0 + 2 * p) * stride_slot;
      // Past the end: the pair's first key again (read, never stored).
      const int8_t* r1 = 2 * p + 1 < m ? r0 + stride_slot : r0;
      __m512i k[kChunks], ku[kChunks];
      for (int c = 0; c < kChunks; ++c) {
        k[c] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32 * c))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 32 * c)), 1);
        ku[c] = _mm512_xor_si512(k[c], flip);
      }
      for (int64_t g = 0; g < group; ++g) {
        const int8_t* hi = qbytes + g * kInt8QueryBytes * kHeadDim;
        const int8_t* lo = hi + 2 * kHeadDim;
        __m512i acc = _mm512_setzero_si512();
        for (int c = 0; c < kChunks; ++c) acc = _mm512_dpbusd_epi32(acc, ku[c], _mm512_loadu_si512(hi + 64 * c));
        acc = _mm512_slli_epi32(acc, 8);
        for (int c = 0; c < kChunks; ++c) acc = _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(lo + 64 * c), k[c]);
        part[g][p] = acc;
      }
      key_scale[2 * p] = row_scale(r0, scale_offset);
      key_scale[2 * p + 1] = 2 * p + 1 < m ? row_scale(r0 + stride_slot, scale_offset) : 0.0f;
    }
    for (int64_t p = 2 * ((m + 1) / 2); p < 16; ++p) key_scale[p] = 0.0f;
    const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1u);
    const __m512 ks = _mm512_load_ps(key_scale);
    for (int64_t g = 0; g < group; ++g) {
      const __m512i dots = _mm512_sub_epi32(reduce_pairs(part[g]), _mm512_set1_epi32(correction[g]));
      const __m512 s = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dots), ks), _mm512_set1_ps(qscale[g]));
      _mm512_mask_storeu_ps(scores + g * bs + j0, keep, s);
    }
  }
}

// int8 values against the softmax weights of a bf16 / fp16 query, in integer maths with vpdpwssd
// (32 signed 16-bit products summed two by two into 16 int32 lanes, one instruction). The float
// loop (block_values) widens every code to float and spends one FMA per code and query vector;
// here two keys' codes share a register, sign-extended to 16 bits and interleaved (key j's code
// for dim d beside key j + 1's), and meet a broadcast pair of the two keys' weights. A weight,
// softmax weight p_j <= 1 times the row's scale s_j, is rounded to 15 bits of the span's largest
// scale: w16 = round(p_j * s_j * 32767 / smax), at most smax / 65534 off, a fraction of the
// int8 code's own rounding (s_j / 2 a value) and finer than the bf16 / fp16 output's, like the
// query's 16 bits in block_scores_vnni. The int32 sums are exact while a span holds at most
// kMaxWeightPairs pairs (kMaxWeightPairs * 2 * 32767 * 127 < 2^31); they are scaled by smax / 32767
// into the float accumulators once per span. A span with a NaN or infinite scale, or a query
// vector whose softmax sum is not finite, takes the float loop, which lets them through as before.

// The value scales of a KV head's span (first_row[b], span_len[b] rows stride_slot bytes apart),
// times 32767 / smax, at factor[0 .. n); *unit = smax / 32767. False if a scale is NaN or infinite.
inline bool span_scale_factors(const int8_t* const* first_row, const int64_t* span_len, int64_t num_blocks,
                               int64_t stride_slot, int64_t scale_offset, float* factor, float* unit) {
  const __m512i index =
      _mm512_add_epi32(_mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(stride_slot))),
                       _mm512_set1_epi32(static_cast<int32_t>(scale_offset)));
  __m512 top = _mm512_setzero_ps(), total = _mm512_setzero_ps();
  int64_t n = 0;  // the span's keys so far
  for (int64_t b = 0; b < num_blocks; n += span_len[b], ++b) {
    for (int64_t j = 0; j < span_len[b]; j += 16) {
      const __mmask16 keep = first_lanes(span_len[b] - j);
      const __m512 scale =
          _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, index, first_row[b] + j * stride_slot, 1);
      _mm512_mask_storeu_ps(factor + n + j, keep, scale);
      top = _mm512_max_ps(top, scale);
      total = _mm512_add_ps(total, scale);  // NaN and infinity stick in a sum of positive scales
    }
  }
  const float sum = _mm512_reduce_add_ps(total), smax = _mm512_reduce_max_ps(top);
  if (!(sum <= std::numeric_limits<float>::max()) || !(smax > 0.0f)) return false;
  const __m512 inv = _mm512_set1_ps(32767.0f / smax);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 keep = first_lanes(n - j);
    _mm512_mask_storeu_ps(factor + j, keep, _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, factor + j), inv));
  }
  *unit = smax / 32767.0f;
  return true;
}

// The span's weights of `group` query vectors as 16-bit pairs for span_values_vnni: vector g's at
// w16 + g * stride, block b's keys from 2 * (pairs before b) on, an odd block's last key paired
// with a zero. weights: vector g's span weights at weights + g * sbs; factor: span_scale_factors'.
inline void span_weights_vnni(const float* weights, int64_t sbs, int64_t group, const float* factor,
                              const int64_t* span_len, int64_t num_blocks, int16_t* w16, int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* wg = weights + g * sbs;
    int16_t* out = w16 + g * stride;
    for (int64_t b = 0, offset = 0, at = 0; b < num_blocks; ++b) {
      const int64_t m = span_len[b];
      for (int64_t j = 0; j < m; j += 16) {
        const __mmask16 keep = first_lanes(m - j);
        const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(keep, wg + offset + j),
                                       _mm512_maskz_loadu_ps(keep, factor + offset + j));
        _mm512_mask_cvtepi32_storeu_epi16(out + at + j, keep, _mm512_cvtps_epi32(w));
      }
      if (m & 1) out[at + m] = 0;
      offset += m;
      at += m + (m & 1);
    }
  }
}

// acc[g * kHeadDim + d] += unit * sum_j w16[g][j] * row_j[d] over the span's blocks (first_row[b],
// span_len[b] keys stride_slot apart) for kGroup query vectors, accumulators in registers.
template <int kHeadDim, int kGroup>
void span_values_vnni_fixed(float* acc, const int16_t* w16, int64_t stride, float unit,
                            const int8_t* const* first_row, const int64_t* span_len, int64_t num_blocks,
                            int64_t stride_slot) {
  constexpr int kChunks = kHeadDim / 32;  // 32 codes a chunk: two int32 registers (lo, hi)
  __m512i sums[kGroup][2 * kChunks];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < 2 * kChunks; ++c) sums[g][c] = _mm512_setzero_si512();

  for (int64_t b = 0, at = 0; b < num_blocks; ++b) {
    const int64_t m = span_len[b];
    for (int64_t j = 0; j < m; j += 2, ++at) {
      const int8_t* r0 = first_row[b] + j * stride_slot;
      const int8_t* r1 = j + 1 < m ? r0 + stride_slot : r0;  // weight 0 past the block's end
      __m512i lo[kChunks], hi[kChunks];
      for (int c = 0; c < kChunks; ++c) {
        const __m256i* p0 = reinterpret_cast<const __m256i*>(r0 + 32 * c);
        const __m256i* p1 = reinterpret_cast<const __m256i*>(r1 + 32 * c);
        const __m512i x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p0));
        const __m512i x1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(p1));
        lo[c] = _mm512_unpacklo_epi16(x0, x1);  // per 128-bit lane L: dims 8L .. 8L + 3 of the chunk
        hi[c] = _mm512_unpackhi_epi16(x0, x1);  // dims 8L + 4 .. 8L + 7
      }
      for (int g = 0; g < kGroup; ++g) {
        int32_t pair;  // the two keys' 16-bit weights (memcpy: int16 storage read as one int32)
        std::memcpy(&pair, w16 + g * stride + 2 * at, sizeof pair);
        const __m512i w = _mm512_set1_epi32(pair);
        for (int c = 0; c < kChunks; ++c) {
          sums[g][2 * c] = _mm512_dpwssd_epi32(sums[g][2 * c], lo[c], w);
          sums[g][2 * c + 1] = _mm512_dpwssd_epi32(sums[g][2 * c + 1], hi[c], w);
        }
      }
    }
  }
  // Back into dim order: dims 0-15 of a chunk are lo's and hi's first halves of each lane, 16-31
  // their second halves.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < kGroup; ++g) {
    const __m512 u = _mm512_set1_ps(unit);
    float* a = acc + g * kHeadDim;
    for (int c = 0; c < kChunks; ++c) {
      const __m512 lo = _mm512_cvtepi32_ps(sums[g][2 * c]), hi = _mm512_cvtepi32_ps(sums[g][2 * c + 1]);
      _mm512_storeu_ps(a + 32 * c,
                       _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, first, hi), u, _mm512_loadu_ps(a + 32 * c)));
      _mm512_storeu_ps(a + 32 * c + 16,
                       _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, second, hi), u, _mm512_loadu_ps(a + 32 * c + 16)));
    }
  }
}

// span_values_vnni_fixed over `group` query vectors, as many at a time as 16 accumulators hold.
template <int kHeadDim>
void span_values_vnni(float* acc, int64_t group, const int16_t* w16, int64_t stride, float unit,
                      const int8_t* const* first_row, const int64_t* span_len, int64_t num_blocks,
                      int64_t stride_slot) {
  constexpr int kPerVector = kHeadDim / 16;
  for (int64_t g = 0; g < group;) {
    const int64_t left = group - g;
    float* a = acc + g * kHeadDim;
    const int16_t* w = w16 + g * stride;
    if constexpr (4 * kPerVector <= 16) {
      if (left >= 4) {
        span_values_vnni_fixed<kHeadDim, 4>(a, w, stride, unit, first_row, span_len, num_blocks, stride_slot);
        g += 4;
        continue;
      }
    }
    if (left >= 2) {
      span_values_vnni_fixed<kHeadDim, 2>(a, w, stride, unit, first_row, span_len, num_blocks, stride_slot);
      g += 2;
      continue;
    }
    span_values_vnni_fixed<kHeadDim, 1>(a, w, stride, unit, first_row, span_len, num_blocks, stride_slot);
    g += 1;
  }
}
#endif

#ifdef CE_ATTENTION_SIMD
// block_values with the group's accumulators in registers (kGroup query heads a KV head).
template <typename C, int kHeadDim, bool kQuantized, int kGroup>
void block_values_fixed(float* acc, const float* weights, int64_t bs, const C* first_row, int64_t stride_slot,
                        int64_t n, int64_t scale_offset) {
  constexpr int kChunks = kHeadDim / kLanes;
  Vec a[kGroup][kChunks];
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < kChunks; ++c) a[g][c] = v_load(acc + g * kHeadDim + kLanes * c);
  for (int64_t j = 0; j < n; ++j) {
    const C* row = first_row + j * stride_slot;
    Vec w[kChunks];
    for (int c = 0; c < kChunks; ++c) w[c] = widen(row + kLanes * c);
    float value_scale = 1.0f;
    if constexpr (kQuantized) value_scale = row_scale(row, scale_offset);
    for (int g = 0; g < kGroup; ++g) {
      const Vec weight = v_set1(weights[g * bs + j] * value_scale);
      for (int c = 0; c < kChunks; ++c) a[g][c] = v_fmadd(weight, w[c], a[g][c]);
    }
  }
  for (int g = 0; g < kGroup; ++g)
    for (int c = 0; c < kChunks; ++c) v_store(acc + g * kHeadDim + kLanes * c, a[g][c]);
}

// Accumulator registers block_values_fixed may keep (half the register file: the rest holds the
// widened row and the weight).
constexpr int kAccumulators = kLanes == 16 ? 16 : 8;

// acc[g * kHeadDim + d] += weights[g * bs + j] * row_j[d] (times row_j's scale when quantized).
template <typename C, int kHeadDim, bool kQuantized>
void block_values(float* acc, int64_t group, const float* weights, int64_t bs, const C* first_row,
                  int64_t stride_slot, int64_t n, int64_t scale_offset) {
  constexpr int kChunks = kHeadDim / kLanes;
  if constexpr (kChunks <= kAccumulators) {
    // Four (or two, or one) query vectors at a time with their accumulators in registers: a
    // larger group (several rows of a sequence, attend_rows) widens the block's rows once per
    // four vectors, from L1 after the first time, instead of loading and storing every
    // accumulator once per row.
    for (int64_t g = 0; g < group;) {
      const int64_t left = group - g;
      float* a = acc + g * kHeadDim;
      const float* w = weights + g * bs;
      if constexpr (4 * kChunks <= kAccumulators) {
        if (left >= 4) {
          block_values_fixed<C, kHeadDim, kQuantized, 4>(a, w, bs, first_row, stride_slot, n, scale_offset);
          g += 4;
          continue;
        }
      }
      if constexpr (2 * kChunks <= kAccumulators) {
        if (left >= 2) {
          block_values_fixed<C, kHeadDim, kQuantized, 2>(a, w, bs, first_row, stride_slot, n, scale_offset);
          g += 2;
          continue;
        }
      }
      block_values_fixed<C, kHeadDim, kQuantized, 1>(a, w, bs, first_row, stride_slot, n, scale_offset);
      g += 1;
    }
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const C* row = first_row + j * stride_slot;
    Vec w[kChunks];
    for (int c = 0; c < kChunks; ++c) w[c] = widen(row + kLanes * c);
    float value_scale = 1.0f;
    if constexpr (kQuantized) value_scale = row_scale(row, scale_offset);
    for (int64_t g = 0; g < group; ++g) {
      const Vec weight = v_set1(weights[g * bs + j] * value_scale);
      float* ag = acc + g * kHeadDim;
      for (int c = 0; c < kChunks; ++c) v_store(ag + kLanes * c, v_fmadd(weight, w[c], v_load(ag + kLanes * c)));
    }
  }
}
#endif

// Row t's keys and values into its cache slot, as kernels/reference.py writes them.
template <typename T, typename C>
void write_row(const Problem& pb, int64_t t) {
  int64_t slot = read_index(pb.slot_mapping, pb.slots64, t);
  if (slot < 0) slot = (pb.num_blocks - 1) * pb.block_size;
  const int64_t base = (slot / pb.block_size) * pb.stride_block + (slot % pb.block_size) * pb.stride_slot;
  const size_t bytes = static_cast<size_t>(pb.head_dim) * sizeof(T);
  for (int64_t h = 0; h < pb.num_kv_heads; ++h) {
    C* key_row = static_cast<C*>(pb.key_cache) + base + h * pb.stride_head;
    C* value_row = static_cast<C*>(pb.value_cache) + base + h * pb.stride_head;
    const T* key = static_cast<const T*>(pb.key) + t * pb.k_stride_t + h * pb.k_stride_h;
    const T* value = static_cast<const T*>(pb.value) + t * pb.v_stride_t + h * pb.v_stride_h;
    if constexpr (quantized<T, C>()) {
      quantize_row(key, key_row, pb.head_dim, pb.scale_offset);
      quantize_row(value, value_row, pb.head_dim, pb.scale_offset);
    } else {
      std::memcpy(key_row, key, bytes);
      std::memcpy(value_row, value, bytes);
    }
  }
}

// Sequence of row t (-1 if the row is padding) and the row's absolute position.
inline int64_t row_sequence(const Problem& pb, int64_t t, int64_t* position) {
  if (t < read_index(pb.query_start_loc, pb.qsl64, 0)) return -1;
  int64_t lo = 0, hi = pb.num_seqs;  // first s with query_start_loc[s + 1] > t
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (read_index(pb.query_start_loc, pb.qsl64, mid + 1) > t) hi = mid; else lo = mid + 1;
  }
  if (lo >= pb.num_seqs) return -1;
  const int64_t end = read_index(pb.query_start_loc, pb.qsl64, lo + 1);
  *position = read_index(pb.seq_lens, pb.sl64, lo) - (end - t);
  return lo;
}

// Attends rows t0 .. t0 + num_rows - 1 (consecutive rows of one sequence, or one padding row) for
// KV heads [head_begin, head_end) and all their query heads. Walking every head of a slot
// together reads the cache's [slot, head, d] rows front to back, which the hardware prefetcher
// follows; one head at a time read a quarter of each row at a stride. The rows share one walk
// over the keys the first of them sees (a verification step's k + 1 rows, a prefill's rows):
// each key and value is read and widened once for all of them, and the few keys a row must not
// see (past its position, or before its window) get a score of -inf, so a zero weight.
template <typename T, typename C, int kHeadDim>
void attend_rows(const Problem& pb, int64_t t0, int64_t num_rows, int64_t head_begin, int64_t head_end,
                 float* work) {
  const int64_t D = kHeadDim > 0 ? kHeadDim : pb.head_dim;
  const int64_t group = pb.num_q_heads / pb.num_kv_heads;
  // Query vectors per KV head: vector i of KV head h is row (i % qgroup) / group's query head
  // h * group + i % group.
  const int64_t qgroup = num_rows * group;
  const int64_t heads = (head_end - head_begin) * qgroup;  // query vectors in this item
  const int64_t bs = pb.block_size;
  const int64_t sbs = kSpan * bs;  // a head's scores: one span of blocks
  const T* query = static_cast<const T*>(pb.query);
  const C* keys = static_cast<const C*>(pb.key_cache);
  const C* values = static_cast<const C*>(pb.value_cache);
  T* out = static_cast<T*>(pb.out);
  const int64_t first_head = head_begin * group;

  // Per query head: q [D], acc [D], scores [block], max, sum (work is sized by the caller).
  float* q = work;
  float* acc = q + heads * D;
  float* scores = acc + heads * D;
  float* row_max = scores + heads * sbs;
  float* row_sum = row_max + heads;
  // int8 keys with a bf16 / fp16 query (block_scores_vnni): the query's scale, correction and bytes.
  float* qscale = row_sum + heads;
  int32_t* qcorrection = reinterpret_cast<int32_t*>(qscale + heads);
  int8_t* qbytes = reinterpret_cast<int8_t*>(qcorrection + heads);
#if defined(CE_ATTENTION_AVX2)
  // int8 keys with a bf16 / fp16 query on AVX2 (block_scores_madd): the query in int16 at qbytes.
  constexpr bool kMadd = std::is_same_v<C, int8_t> && !std::is_same_v<T, float> && kHeadDim > 0 &&
                         kHeadDim % 16 == 0 && kHeadDim <= 256;
  int16_t* q16 = reinterpret_cast<int16_t*>(qbytes);
#endif
#if defined(CE_ATTENTION_AVX512) && defined(__AVX512VNNI__)
  constexpr bool kVnni = std::is_same_v<C, int8_t> && !std::is_same_v<T, float> && kHeadDim > 0 &&
                         kHeadDim % 64 == 0 && kHeadDim <= 128;
  constexpr bool kIntValues = kVnni;
#elif defined(CE_ATTENTION_AVX2)
  constexpr bool kIntValues = kMadd && kHeadDim % 32 == 0;
#endif
#if defined(CE_ATTENTION_INT_VALUES)
  // ... and its values (span_values_vnni / _madd): one KV head's span of scale factors and 16-bit
  // weights, after the query's 4 bytes a head dim (as run sizes the work).
  float* factor = reinterpret_cast<float*>(qbytes + heads * 4 * D);
  int16_t* w16 = reinterpret_cast<int16_t*>(factor + sbs);
  const int64_t w16_stride = weight_pairs_stride(bs);
  // The span's int32 sums stay exact for blocks of up to ~127 keys.
  const bool int_values = kSpan * (bs + 1) <= 2 * kMaxWeightPairs;
#endif

  int64_t position = -1;  // row t0's; row t0 + r is at position + r
  const int64_t seq = row_sequence(pb, t0, &position);
  // Keys [lo, hi) are visible to some row: causal up to the last row's position, inside the first
  // row's window, inside the table. Row r sees [row_lo(r), position + r] of them.
  const int64_t hi = seq < 0 ? 0 : std::min(position + num_rows, pb.width * bs);
  auto row_lo = [&](int64_t r) {
    return pb.sliding_window <= 0 ? int64_t{0} : std::max<int64_t>(0, position + r - pb.sliding_window + 1);
  };
  const int64_t lo = seq < 0 ? 0 : row_lo(0);

  const bool capped = pb.softcap > 0.0f;
  // Without a cap the scale folds into the query; with one it applies before the tanh.
  const float qs = capped ? 1.0f : pb.scale;
  auto query_head = [&](int64_t i) {  // vector i's query head
    return first_head + (i / qgroup) * group + i % group;
  };
  auto row_of = [&](int64_t i) { return (i % qgroup) / group; };
  for (int64_t i = 0; i < heads; ++i) {
    const int64_t base = (t0 + row_of(i)) * pb.q_stride_t + query_head(i) * pb.q_stride_h;
    for (int64_t d = 0; d < D; ++d) q[i * D + d] = load(query, base + d) * qs;
    for (int64_t d = 0; d < D; ++d) acc[i * D + d] = 0.0f;
    row_max[i] = -std::numeric_limits<float>::infinity();
    row_sum[i] = 0.0f;
  }
#if defined(CE_ATTENTION_AVX512) && defined(__AVX512VNNI__)
  if constexpr (kVnni) {
    for (int64_t i = 0; i < heads; ++i)
      quantize_query_vnni<kHeadDim>(q + i * D, qbytes + i * kInt8QueryBytes * D, qcorrection + i, qscale + i);
  }
#endif
#if defined(CE_ATTENTION_AVX2)
  if constexpr (kMadd) {
    for (int64_t i = 0; i < heads; ++i) quantize_query_int16<kHeadDim>(q + i * D, q16 + i * D, qscale + i);
  }
#endif

  // Blocks sit anywhere in the cache, so the hardware prefetcher restarts cold at each one. The
  // fast path asks for each span's data one phase before it is read: its values while its scores
  // are computed, the next span's keys while its values are summed (and the first kAhead blocks'
  // keys and values up front). Asking instead for the keys and values of the block kAhead columns
  // on while each block's scores are computed measured slower for bf16 and int8 caches alike
  // (docs/kv_cache_quantization.md, "Speed"). The plain loops keep that prefetch, spread over a
  // block's keys.
  const int64_t row_bytes = (head_end - head_begin) * pb.stride_head * static_cast<int64_t>(sizeof(C));
  const int64_t last_column = (hi - 1) / bs;
  auto block_offset = [&](int64_t column) {  // where the block at this table column starts
    int64_t block = read_index(pb.block_tables, pb.bt64, seq * pb.bt_stride + column);
    block = std::min(std::max<int64_t>(block, 0), pb.num_blocks - 1);  // never read outside the cache
    return block * pb.stride_block;
  };
  auto prefetch_slot = [&](int64_t block_start, int64_t slot) {  // this item's heads of one slot
    const int64_t at = block_start + slot * pb.stride_slot + head_begin * pb.stride_head;
    prefetch_row<3>(keys + at, row_bytes);
    prefetch_row<3>(values + at, row_bytes);
  };
  if (lo < hi) {
    for (int64_t c = lo / bs; c < std::min(lo / bs + kAhead, last_column + 1); ++c) {
      const int64_t block_start = block_offset(c);
      for (int64_t r = 0; r < bs; ++r) prefetch_slot(block_start, r);
    }
  }

  // kSpan blocks at a time: their scores first, then one online-softmax update over all of them,
  // then their values. The softmax's per-update work (two lane reductions, the exponentials'
  // set-up, rescaling every accumulator) is then paid once per span, not once per 16-key block.
  for (int64_t start = lo; start < hi;) {
    const int64_t span_start = start;  // the key scores[i * sbs] belongs to
    int64_t span_slot[kSpan], span_len[kSpan];
    int64_t num_blocks = 0, n = 0;  // blocks in this span, keys in them
    bool fast = false;  // the SIMD block loops below ran (head dims of kLanes' multiples, small groups)
    for (; num_blocks < kSpan && start < hi; ++num_blocks) {
      const int64_t column = start / bs;
      const int64_t stop = std::min(hi, (column + 1) * bs);
      const int64_t m = stop - start;
      const int64_t first_slot = block_offset(column) + (start - column * bs) * pb.stride_slot;
      span_slot[num_blocks] = first_slot;
      span_len[num_blocks] = m;

#ifdef CE_ATTENTION_SIMD
      if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
        if (qgroup <= kFastGroup) {
          {
            // This block's values, read after the span's scores (on a Zen 5, asking for them here,
            // into L1, took ~25% off an int8 cache's time, when the kAhead prefetch alone left
            // them waiting on memory).
            const int64_t at = first_slot + head_begin * pb.stride_head;
            for (int64_t r = 0; r < m; ++r) prefetch_row<3>(values + at + r * pb.stride_slot, row_bytes);
          }
          for (int64_t h = head_begin; h < head_end; ++h) {
            const int64_t i0 = (h - head_begin) * qgroup;
#if defined(CE_ATTENTION_AVX2)
            if constexpr (kMadd) {
              block_scores_madd<kHeadDim>(q16 + i0 * D, qscale + i0, qgroup, keys + first_slot + h * pb.stride_head,
                                          pb.stride_slot, m, pb.scale_offset, scores + i0 * sbs + n, sbs);
              continue;
            }
#endif
#if defined(CE_ATTENTION_AVX512) && defined(__AVX512VNNI__)
            if constexpr (kVnni) {
              block_scores_vnni<kHeadDim>(qbytes + i0 * kInt8QueryBytes * D, qcorrection + i0, qscale + i0, qgroup,
                                          keys + first_slot + h * pb.stride_head, pb.stride_slot, m,
                                          pb.scale_offset, scores + i0 * sbs + n, sbs);
              continue;
            }
#endif
            block_scores<C, kHeadDim, quantized<T, C>()>(q + i0 * D, qgroup, keys + first_slot + h * pb.stride_head,
                                                         pb.stride_slot, m, pb.scale_offset, scores + i0 * sbs + n,
                                                         sbs);
          }
          fast = true;
        }
      }
#endif
      // The plain loops' prefetch: the block kAhead columns on (the block loops ask a phase early).
      const int64_t ahead = !fast && column + kAhead <= last_column ? block_offset(column + kAhead) : -1;
      for (int64_t j = 0; j < m && !fast; ++j) {
        if (ahead >= 0) {  // all bs rows of it, also when this block is partial
          for (int64_t r = j; r < bs; r += m) prefetch_slot(ahead, r);
        }
        for (int64_t h = head_begin; h < head_end; ++h) {
          const int64_t k = first_slot + j * pb.stride_slot + h * pb.stride_head;
          // Quantized: the dot over the codes, then the row's scale once.
          float key_scale = 1.0f;
          if constexpr (quantized<T, C>()) key_scale = row_scale(keys + k, pb.scale_offset);
          for (int64_t g = 0; g < qgroup; ++g) {
            const int64_t i = (h - head_begin) * qgroup + g;
            float s = dot_row<C, kHeadDim>(q + i * D, keys + k, D);
            if constexpr (quantized<T, C>()) s *= key_scale;
            scores[i * sbs + n + j] = s;
          }
        }
      }
      n += m;
      start = stop;
    }
    for (int64_t i = 0; i < heads; ++i) {
      float* si = scores + i * sbs;
      if (capped) {
        for (int64_t j = 0; j < n; ++j) si[j] = pb.softcap * std::tanh(si[j] * pb.scale / pb.softcap);
      }
      if (num_rows > 1) {  // this vector's row sees keys [row_lo(r), position + r] of the span
        const int64_t r = row_of(i);
        const int64_t before = std::min(n, std::max<int64_t>(0, row_lo(r) - span_start));
        const int64_t after = std::max<int64_t>(before, std::min(n, position + r + 1 - span_start));
        for (int64_t j = 0; j < before; ++j) si[j] = -std::numeric_limits<float>::infinity();
        for (int64_t j = after; j < n; ++j) si[j] = -std::numeric_limits<float>::infinity();
        if (before == after) {  // none of this span: zero weights, nothing to update
          for (int64_t j = 0; j < n; ++j) si[j] = 0.0f;
          continue;
        }
      }
      float block_max = row_max[i];
#if defined(__AVX512F__)
      // Both softmax loops in 16-lane vectors (GCC leaves them scalar), on every cache
      // (docs/kv_cache_quantization.md, "Speed").
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 keep = first_lanes(n - j);
        block_max = std::max(block_max, _mm512_mask_reduce_max_ps(keep, _mm512_maskz_loadu_ps(keep, si + j)));
      }
#elif defined(CE_ATTENTION_AVX2)
      {
        // max(x, top): a NaN score is passed over, as std::max below does.
        __m256 top = _mm256_set1_ps(block_max);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) top = _mm256_max_ps(_mm256_loadu_ps(si + j), top);
        block_max = v_max(top);  // top started at block_max
        for (; j < n; ++j) block_max = std::max(block_max, si[j]);
      }
#else
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, si[j]);
#endif
      // First span: the old max is -inf and there is nothing to rescale.
      const float correction = row_max[i] == -std::numeric_limits<float>::infinity()
                                   ? 0.0f
                                   : exp_nonpositive(row_max[i] - block_max);
      row_max[i] = block_max;
      float block_sum = 0.0f;
#if defined(__AVX512F__)
      {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 keep = first_lanes(n - j);
          const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, si + j), _mm512_set1_ps(block_max)));
          _mm512_mask_storeu_ps(si + j, keep, e);
          sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(keep, e));  // lanes past n: exp(0 - max), dropped
        }
        block_sum = _mm512_reduce_add_ps(sum);
      }
#elif defined(CE_ATTENTION_AVX2)
      {
        __m256 sum = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
          const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(si + j), _mm256_set1_ps(block_max)));
          _mm256_storeu_ps(si + j, e);
          sum = _mm256_add_ps(sum, e);
        }
        block_sum = v_sum(sum);
        for (; j < n; ++j) {
          si[j] = exp_nonpositive(si[j] - block_max);
          block_sum += si[j];
        }
      }
#else
      {
#pragma omp simd reduction(+ : block_sum)
        for (int64_t j = 0; j < n; ++j) {
          si[j] = exp_nonpositive(si[j] - block_max);
          block_sum += si[j];
        }
      }
#endif
      row_sum[i] = row_sum[i] * correction + block_sum;
      if (correction != 1.0f) {
        float* ai = acc + i * D;
        for (int64_t d = 0; d < D; ++d) ai[d] *= correction;
      }
    }
    // Heads whose span of values went through the integer loop (bit h - head_begin).
    [[maybe_unused]] uint64_t int_heads = 0;
#if defined(CE_ATTENTION_INT_VALUES)
    if constexpr (kIntValues) {
      if (fast && int_values && head_end - head_begin <= 64) {
        for (int64_t h = head_begin; h < head_end; ++h) {
          const int64_t i0 = (h - head_begin) * qgroup;
          bool finite = true;  // every vector's softmax sum: no NaN or infinite weight
          for (int64_t g = 0; g < qgroup; ++g) finite = finite && std::isfinite(row_sum[i0 + g]);
          const int8_t* first_row[kSpan];
          for (int64_t b = 0; b < num_blocks; ++b) first_row[b] = values + span_slot[b] + h * pb.stride_head;
          float unit = 0.0f;
          if (!finite ||
              !span_scale_factors(first_row, span_len, num_blocks, pb.stride_slot, pb.scale_offset, factor, &unit))
            continue;  // the float loop below
          span_weights_vnni(scores + i0 * sbs, sbs, qgroup, factor, span_len, num_blocks, w16, w16_stride);
#if defined(CE_ATTENTION_AVX2)
          span_values_madd<kHeadDim>(acc + i0 * D, qgroup, w16, w16_stride, unit, first_row, span_len, num_blocks,
                                     pb.stride_slot);
#else
          span_values_vnni<kHeadDim>(acc + i0 * D, qgroup, w16, w16_stride, unit, first_row, span_len, num_blocks,
                                     pb.stride_slot);
#endif
          int_heads |= uint64_t{1} << (h - head_begin);
        }
      }
    }
#endif
    for (int64_t b = 0, offset = 0; b < num_blocks; offset += span_len[b], ++b) {
      const int64_t first_slot = span_slot[b];
      const int64_t m = span_len[b];
      if (fast && start < hi && start / bs + b <= last_column) {  // the next span's keys
        // Written out here: GCC made a slower loop of the same lines as a lambda call.
        const int64_t at = block_offset(start / bs + b) + head_begin * pb.stride_head;
        for (int64_t r = 0; r < bs; ++r) prefetch_row<3>(keys + at + r * pb.stride_slot, row_bytes);
      }
#ifdef CE_ATTENTION_SIMD
      if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) {
        if (fast) {
          for (int64_t h = head_begin; h < head_end; ++h) {
            const int64_t i0 = (h - head_begin) * qgroup;
            if (int_heads & (uint64_t{1} << (h - head_begin))) continue;  // done for the span above
            block_values<C, kHeadDim, quantized<T, C>()>(acc + i0 * D, qgroup, scores + i0 * sbs + offset, sbs,
                                                         values + first_slot + h * pb.stride_head, pb.stride_slot, m,
                                                         pb.scale_offset);
          }
        }
      }
#endif
      for (int64_t j = 0; j < m && !fast; ++j) {
        for (int64_t h = head_begin; h < head_end; ++h) {
          const int64_t v = first_slot + j * pb.stride_slot + h * pb.stride_head;
          // Quantized: the row's scale rides on the softmax weight.
          float value_scale = 1.0f;
          if constexpr (quantized<T, C>()) value_scale = row_scale(values + v, pb.scale_offset);
          for (int64_t g = 0; g < qgroup; ++g) {
            const int64_t i = (h - head_begin) * qgroup + g;
            const float w = scores[i * sbs + offset + j] * value_scale;
            axpy_row<C, kHeadDim>(acc + i * D, w, values + v, D);
          }
        }
      }
    }
  }

  for (int64_t i = 0; i < heads; ++i) {
    // A row with no visible key (padding, or an empty window) gives zeros.
    const float inv = row_sum[i] > 0.0f ? 1.0f / row_sum[i] : 0.0f;
    const int64_t base = ((t0 + row_of(i)) * pb.num_q_heads + query_head(i)) * D;
    for (int64_t d = 0; d < D; ++d) store(out, base + d, acc[i * D + d] * inv);
  }
}

// Rows that attend together (attend_rows): up to this many consecutive rows of one sequence, as
// many as the fast path's kFastGroup query vectors per KV head hold (one row where the fast path
// does not run); a padding row alone. As (first row, count) pairs.
template <int kHeadDim>
std::vector<std::pair<int64_t, int64_t>> row_runs(const Problem& pb) {
  const int64_t group = pb.num_q_heads / pb.num_kv_heads;
  int64_t max_rows = 1;
#ifdef CE_ATTENTION_SIMD
  if constexpr (kHeadDim > 0 && kHeadDim % kLanes == 0) max_rows = std::max<int64_t>(1, kFastGroup / group);
#endif
  std::vector<std::pair<int64_t, int64_t>> runs;
  const int64_t first = std::min(read_index(pb.query_start_loc, pb.qsl64, 0), pb.num_tokens);
  for (int64_t t = 0; t < first; ++t) runs.emplace_back(t, 1);
  int64_t end = first;
  for (int64_t s = 0; s < pb.num_seqs; ++s) {
    const int64_t seq_end = std::min(read_index(pb.query_start_loc, pb.qsl64, s + 1), pb.num_tokens);
    for (int64_t t = end; t < seq_end; t += max_rows) runs.emplace_back(t, std::min(max_rows, seq_end - t));
    end = std::max(end, seq_end);
  }
  for (int64_t t = end; t < pb.num_tokens; ++t) runs.emplace_back(t, 1);
  return runs;
}

template <typename T, typename C, int kHeadDim>
void run(const Problem& pb, int num_threads) {
  const std::vector<std::pair<int64_t, int64_t>> runs = row_runs<kHeadDim>(pb);
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  int64_t max_rows = 1;
  for (const auto& run : runs) max_rows = std::max(max_rows, run.second);
  // Whole runs of rows when there are enough of them to share out; with few (batch-1 decode, one
  // sequence's verification) split the KV heads too, so every thread has work.
  int64_t chunks = 1;
  while (chunks < pb.num_kv_heads && num_runs * chunks < 2 * num_threads) chunks *= 2;
  chunks = std::min(chunks, pb.num_kv_heads);
  const int64_t per_chunk = (pb.num_kv_heads + chunks - 1) / chunks;
  const int64_t items = num_runs * chunks;
  const int64_t group = pb.num_q_heads / pb.num_kv_heads;
  const int64_t heads = per_chunk * group * max_rows;
  // q, acc, scores, max, sum; then the int8-key query's scales, corrections and bytes (4 a value);
  // then the int8 values' span scale factors and 16-bit weights (attend_rows).
  const int64_t work_floats = heads * (2 * pb.head_dim + kSpan * pb.block_size + 2) + heads * (2 + pb.head_dim) +
                              kSpan * pb.block_size + heads * weight_pairs_stride(pb.block_size) / 2;
#pragma omp parallel num_threads(num_threads)
  {
    // The write first; the loop's barrier keeps every read after it. Padding rows all land on
    // the scratch slot, which nothing reads.
#pragma omp for schedule(static)
    for (int64_t t = 0; t < pb.num_tokens; ++t) write_row<T, C>(pb, t);
    std::vector<float> work(static_cast<size_t>(work_floats) + 16);
    // Dynamic: under a causal prefill later rows see more keys than earlier ones.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t head_begin = (item % chunks) * per_chunk;
      const int64_t head_end = std::min(pb.num_kv_heads, head_begin + per_chunk);
      const auto& [t0, num_rows] = runs[static_cast<size_t>(item / chunks)];
      if (head_begin < head_end) attend_rows<T, C, kHeadDim>(pb, t0, num_rows, head_begin, head_end, work.data());
    }
  }
}

template <typename T, typename C>
void dispatch_head_dim(const Problem& pb, int num_threads) {
  switch (pb.head_dim) {
    case 64: run<T, C, 64>(pb, num_threads); break;
    case 128: run<T, C, 128>(pb, num_threads); break;
    default: run<T, C, 0>(pb, num_threads); break;
  }
}

// The cache's kind: 0 the query's dtype, 1 int8 codes, 2 fp8 e4m3 codes (kernels/cpu_attention.py).
template <typename T>
int dispatch_cache(const Problem& pb, int64_t kv_kind, int num_threads) {
  switch (kv_kind) {
    case 0: dispatch_head_dim<T, T>(pb, num_threads); return 0;
    case 1: dispatch_head_dim<T, int8_t>(pb, num_threads); return 0;
    case 2: dispatch_head_dim<T, uint8_t>(pb, num_threads); return 0;
    default: return 2;
  }
}

}  // namespace

extern "C" {

// Which block loops this build has: 512 (AVX-512), 256 (AVX2 + FMA + F16C) or 0 (plain loops only).
int ce_cpu_attention_simd_bits() {
#if defined(CE_ATTENTION_AVX512)
  return 512;
#elif defined(CE_ATTENTION_AVX2)
  return 256;
#else
  return 0;
#endif
}

// `ints` holds, in this order (pointers as integers; strides in elements; flags 0/1):
//   query, q_stride_t, q_stride_h, key, k_stride_t, k_stride_h, value, v_stride_t, v_stride_h,
//   key_cache, value_cache, stride_block, stride_slot, stride_head, slot_mapping, slots64,
//   block_tables, bt_stride, bt64, seq_lens, sl64, query_start_loc, qsl64, out,
//   num_tokens, num_seqs, width, num_blocks, block_size, num_q_heads, num_kv_heads, head_dim,
//   sliding_window, dtype (0 float32, 1 bfloat16, 2 float16: query, keys and output share it,
//   and so does the cache unless quantized), num_threads, kv_kind (0 the cache holds dtype,
//   1 int8 rows, 2 fp8 e4m3 rows; strides then count bytes), scale_offset (quantized rows:
//   bytes from a row's start to its float32 scale)
// (one array, not 37 arguments: the call runs once per layer per step, and every foreign
// argument costs the Python caller time). Returns 0; 3 if a slot lies past the cache (nothing
// is written then); 1 or 2 for sizes or a dtype it cannot take (the Python side checks those
// first: a backstop).
int ce_cpu_paged_attention(const int64_t* ints, float scale, float softcap) {
  const int64_t* a = ints;
  auto ptr = [](int64_t v) { return reinterpret_cast<void*>(static_cast<intptr_t>(v)); };
  Problem pb{};
  pb.query = ptr(a[0]), pb.q_stride_t = a[1], pb.q_stride_h = a[2];
  pb.key = ptr(a[3]), pb.k_stride_t = a[4], pb.k_stride_h = a[5];
  pb.value = ptr(a[6]), pb.v_stride_t = a[7], pb.v_stride_h = a[8];
  pb.key_cache = ptr(a[9]), pb.value_cache = ptr(a[10]);
  pb.stride_block = a[11], pb.stride_slot = a[12], pb.stride_head = a[13];
  pb.slot_mapping = ptr(a[14]), pb.slots64 = a[15] != 0;
  pb.block_tables = ptr(a[16]), pb.bt_stride = a[17], pb.bt64 = a[18] != 0;
  pb.seq_lens = ptr(a[19]), pb.sl64 = a[20] != 0;
  pb.query_start_loc = ptr(a[21]), pb.qsl64 = a[22] != 0;
  pb.out = ptr(a[23]);
  pb.num_tokens = a[24], pb.num_seqs = a[25], pb.width = a[26], pb.num_blocks = a[27];
  pb.block_size = a[28], pb.num_q_heads = a[29], pb.num_kv_heads = a[30], pb.head_dim = a[31];
  pb.sliding_window = a[32];
  pb.scale = scale, pb.softcap = softcap;
  const int64_t dtype = a[33];
  const int num_threads = static_cast<int>(a[34]);
  const int64_t kv_kind = a[35];
  pb.scale_offset = a[36];
  if (kv_kind != 0 && pb.scale_offset < pb.head_dim) return 1;
  if (pb.num_kv_heads <= 0 || pb.num_q_heads % pb.num_kv_heads != 0 || pb.head_dim <= 0 ||
      pb.block_size <= 0 || pb.num_seqs <= 0 || pb.num_blocks <= 0 || num_threads <= 0) {
    return 1;
  }
  if (pb.num_tokens <= 0) return 0;
  const int64_t num_slots = pb.num_blocks * pb.block_size;
  for (int64_t t = 0; t < pb.num_tokens; ++t) {  // a slot past the cache would write outside it
    if (read_index(pb.slot_mapping, pb.slots64, t) >= num_slots) return 3;
  }
  switch (dtype) {
    case 0: return dispatch_cache<float>(pb, kv_kind, num_threads);
    case 1: return dispatch_cache<uint16_t>(pb, kv_kind, num_threads);
    case 2: return dispatch_cache<_Float16>(pb, kv_kind, num_threads);
    default: return 2;
  }
}

}  // extern "C"
