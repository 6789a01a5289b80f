// The CPU sampler's two per-row picks over the vocabulary, called through ctypes by
// kernels/cpu_sampler.py, which documents the contract. Built at run time by
// kernels/cpu_attention_build.py (g++ -O3 -march=native -fopenmp).
//
// - ce_cpu_greedy: each row's argmax, as torch's `logits.argmax(dim=-1)` answers it (the first
//   index of the row's largest value; the first NaN where the row has one).
// - ce_cpu_temperature_draw: one token per row from softmax(logits / t), drawn with one uniform
//   number u per row as worker/sampler.py's `categorical_draw` draws it: the first index whose
//   running sum of exp((x - max) / t) exceeds u times the row's total.
//
// Why: torch's CPU ops went through a step's logits several times at one to two billion values a
// second: `max(dim=-1)` for greedy rows took 0.13-0.23 ms a step for 64 rows of a 4,000-token
// vocabulary; amax, subtract, divide, softmax, cumsum and searchsorted for temperature rows took
// 1.8-2.0 ms for 256 (docs/performance.md). Here each row is read from L1 in a few vector passes.
//
// Paths (`simd`): 1 = AVX-512 (16 values a vector; bf16 widened by shifting its bits, fp16 with
// F16C) where the library was built with it, else AVX2 + FMA + F16C (the same loops, 8 values a
// vector), 0 = plain loops (CPUs with neither; the tests force it). A greedy row with a NaN takes
// the plain loop, which stops at the first NaN.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_exp.h"  // exp_nonpositive, exp_nonpositive8, exp_nonpositive16

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
#include <immintrin.h>
#define CE_SAMPLER_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define CE_SAMPLER_AVX2 1
#endif

namespace {

using ce_exp::exp_nonpositive;
#ifdef CE_SAMPLER_AVX512
using ce_exp::exp_nonpositive16;
#endif
#ifdef CE_SAMPLER_AVX2
using ce_exp::exp_nonpositive8;
#endif

enum Dtype { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

constexpr int64_t kGroup = 64;  // weights per running-sum group of the temperature draw

inline float load_one(const void* row, int64_t i, int dtype) {
  switch (dtype) {
    case kFloat32: return static_cast<const float*>(row)[i];
    case kBFloat16: {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(row)[i]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      return f;
    }
    default: return static_cast<float>(static_cast<const _Float16*>(row)[i]);
  }
}

// The first NaN, else the first index of the largest value (the first of equal ones: -0.0 and
// 0.0 are equal, as torch compares them).
int64_t pick_portable(const void* row, int64_t n, int dtype) {
  float best = load_one(row, 0, dtype);
  if (std::isnan(best)) return 0;
  int64_t index = 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = load_one(row, i, dtype);
    if (std::isnan(v)) return i;
    if (v > best) {
      best = v;
      index = i;
    }
  }
  return index;
}

// categorical_draw over exp((x - max) / t), one value at a time. weights: n floats of room.
int64_t draw_portable(const void* row, int64_t n, int dtype, float t, float u, float* weights) {
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float v = load_one(row, i, dtype);
    if (std::isnan(v)) return pick_portable(row, n, dtype);
    if (v > top) top = v;
  }
  if (top == -INFINITY) return 0;  // nothing to draw from: argmax's answer
  const float inv_t = 1.0f / t;
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    weights[i] = exp_nonpositive((load_one(row, i, dtype) - top) * inv_t);
    total += weights[i];
  }
  const float target = u * total;
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    sum += weights[i];
    if (sum > target) return i;
  }
  return pick_portable(row, n, dtype);  // u * total rounded up to the total: the likeliest
}

#if defined(CE_SAMPLER_AVX512) || defined(CE_SAMPLER_AVX2)
// The vector draws' second half: the weights past the whole vectors (whole .. n), then the walk
// over the groups' sums (groups of them, kGroup weights each but the last) and the crossing
// group's weights to the first index whose running sum exceeds u * total; -1 when rounding puts
// u * total at the total (the caller answers the argmax).
int64_t walk_to_draw(const void* row, int64_t n, int dtype, float t, float u, int64_t whole, float* weights,
                     const float* sums, int64_t groups, float top) {
  float tail = 0.0f;
  for (int64_t i = whole; i < n; ++i) {
    weights[i] = exp_nonpositive((load_one(row, i, dtype) - top) * (1.0f / t));
    tail += weights[i];
  }
  float total = 0.0f;
  for (int64_t j = 0; j < groups; ++j) total += sums[j];
  total += tail;
  const float target = u * total;
  float sum = 0.0f;
  for (int64_t j = 0; j < groups; ++j) {
    if (sum + sums[j] > target) {  // the crossing is in this group (or rounding puts it past)
      for (int64_t i = kGroup * j, stop = std::min(kGroup * (j + 1), whole); i < stop; ++i) {
        sum += weights[i];
        if (sum > target) return i;
      }
      continue;  // the group's own sum rounded differently: go on from where its values left off
    }
    sum += sums[j];
  }
  for (int64_t i = whole; i < n; ++i) {
    sum += weights[i];
    if (sum > target) return i;
  }
  return -1;
}
#endif

#ifdef CE_SAMPLER_AVX512
// Values i .. i + 15 of the row as floats.
inline __m512 load16(const void* row, int64_t i, int dtype) {
  switch (dtype) {
    case kFloat32: return _mm512_loadu_ps(static_cast<const float*>(row) + i);
    case kBFloat16: {
      const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    }
    default:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const _Float16*>(row) + i)));
  }
}

// The row's largest value over its whole vectors and tail; NaN if it holds one.
inline float row_max(const void* row, int64_t n, int dtype) {
  const int64_t whole = n - n % 16;
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 v = load16(row, i, dtype);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  if (unordered != 0) return NAN;
  float best = _mm512_reduce_max_ps(top);
  for (int64_t i = whole; i < n; ++i) {
    const float v = load_one(row, i, dtype);
    if (std::isnan(v)) return NAN;
    if (v > best) best = v;
  }
  return best;
}

// pick_portable's answer: the row's maximum (a NaN hands the row to pick_portable), then the first
// index equal to it.
int64_t pick_avx512(const void* row, int64_t n, int dtype) {
  const float best = row_max(row, n, dtype);
  if (std::isnan(best)) return pick_portable(row, n, dtype);
  const int64_t whole = n - n % 16;
  const __m512 wanted = _mm512_set1_ps(best);
  for (int64_t i = 0; i < whole; i += 16) {
    const __mmask16 equal = _mm512_cmp_ps_mask(load16(row, i, dtype), wanted, _CMP_EQ_OQ);
    if (equal != 0) return i + __builtin_ctz(static_cast<unsigned>(equal));
  }
  for (int64_t i = whole; i < n; ++i) {
    if (load_one(row, i, dtype) == best) return i;
  }
  return 0;  // not reached: `best` is one of the row's values
}

// draw_portable's draw, 16 weights a vector: the weights are written once (weights: n floats of
// room) with the sum of each group of kGroup beside them (sums: n / kGroup + 1 floats; one lane
// reduction a group, not one a vector), then the running sum walks the groups' sums to the one
// that crosses u * total and its weights one by one.

int64_t draw_avx512(const void* row, int64_t n, int dtype, float t, float u, float* weights, float* sums) {
  const float top = row_max(row, n, dtype);
  if (std::isnan(top)) return pick_portable(row, n, dtype);
  if (top == -INFINITY) return 0;
  const int64_t whole = n - n % 16;
  const __m512 shift = _mm512_set1_ps(top);
  const __m512 inv_t = _mm512_set1_ps(1.0f / t);
  int64_t groups = 0;
  __m512 group_sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 w = exp_nonpositive16(_mm512_mul_ps(_mm512_sub_ps(load16(row, i, dtype), shift), inv_t));
    _mm512_storeu_ps(weights + i, w);
    group_sum = _mm512_add_ps(group_sum, w);
    if ((i + 16) % kGroup == 0 || i + 16 == whole) {
      sums[groups++] = _mm512_reduce_add_ps(group_sum);
      group_sum = _mm512_setzero_ps();
    }
  }
  const int64_t token = walk_to_draw(row, n, dtype, t, u, whole, weights, sums, groups, top);
  return token >= 0 ? token : pick_avx512(row, n, dtype);  // -1: u * total rounded up to the total, the likeliest
}
#endif

#ifdef CE_SAMPLER_AVX2
// The AVX-512 paths above, 8 values a vector.

// Values i .. i + 7 of the row as floats.
inline __m256 load8(const void* row, int64_t i, int dtype) {
  switch (dtype) {
    case kFloat32: return _mm256_loadu_ps(static_cast<const float*>(row) + i);
    case kBFloat16: {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    default:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const _Float16*>(row) + i)));
  }
}

inline float lanes_max(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + 8);
}

inline float lanes_sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// row_max's answer.
inline float row_max8(const void* row, int64_t n, int dtype) {
  const int64_t whole = n - n % 8;
  __m256 top = _mm256_set1_ps(-INFINITY);
  __m256 unordered = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = load8(row, i, dtype);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top = _mm256_max_ps(top, v);
  }
  if (_mm256_movemask_ps(unordered) != 0) return NAN;
  float best = lanes_max(top);
  for (int64_t i = whole; i < n; ++i) {
    const float v = load_one(row, i, dtype);
    if (std::isnan(v)) return NAN;
    if (v > best) best = v;
  }
  return best;
}

// pick_avx512's answer.
int64_t pick_avx2(const void* row, int64_t n, int dtype) {
  const float best = row_max8(row, n, dtype);
  if (std::isnan(best)) return pick_portable(row, n, dtype);
  const int64_t whole = n - n % 8;
  const __m256 wanted = _mm256_set1_ps(best);
  for (int64_t i = 0; i < whole; i += 8) {
    const int equal = _mm256_movemask_ps(_mm256_cmp_ps(load8(row, i, dtype), wanted, _CMP_EQ_OQ));
    if (equal != 0) return i + __builtin_ctz(static_cast<unsigned>(equal));
  }
  for (int64_t i = whole; i < n; ++i) {
    if (load_one(row, i, dtype) == best) return i;
  }
  return 0;  // not reached: `best` is one of the row's values
}

// draw_avx512's draw (weights and the kGroup groups' sums written once, then the walk).
int64_t draw_avx2(const void* row, int64_t n, int dtype, float t, float u, float* weights, float* sums) {
  const float top = row_max8(row, n, dtype);
  if (std::isnan(top)) return pick_portable(row, n, dtype);
  if (top == -INFINITY) return 0;
  const int64_t whole = n - n % 8;
  const __m256 shift = _mm256_set1_ps(top);
  const __m256 inv_t = _mm256_set1_ps(1.0f / t);
  int64_t groups = 0;
  __m256 group_sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 w = exp_nonpositive8(_mm256_mul_ps(_mm256_sub_ps(load8(row, i, dtype), shift), inv_t));
    _mm256_storeu_ps(weights + i, w);
    group_sum = _mm256_add_ps(group_sum, w);
    if ((i + 8) % kGroup == 0 || i + 8 == whole) {
      sums[groups++] = lanes_sum(group_sum);
      group_sum = _mm256_setzero_ps();
    }
  }
  const int64_t token = walk_to_draw(row, n, dtype, t, u, whole, weights, sums, groups, top);
  return token >= 0 ? token : pick_avx2(row, n, dtype);  // -1: u * total rounded up to the total, the likeliest
}
#endif

// Rows of at least this many values in all are shared out over the threads: below it the
// threads' start-up costs more than the work (64 rows of 4,000 take a few microseconds).
constexpr int64_t kParallelValues = int64_t{1} << 18;

bool bad_sizes(int64_t rows, int64_t n, int64_t row_stride, int dtype, int num_threads) {
  return rows < 0 || n < 1 || row_stride < n || dtype < 0 || dtype > 2 || num_threads < 1;
}

// The threads a call of `rows` rows of `n` values runs on: all of them when there is enough work,
// else one.
int team_size(int64_t rows, int64_t n, int num_threads) {
  return num_threads > 1 && rows > 1 && rows * n >= kParallelValues ? num_threads : 1;
}

// f(r) for every row, on team_size's threads.
template <typename F>
void for_rows(int64_t rows, int64_t n, int num_threads, F f) {
  const int threads = team_size(rows, n, num_threads);
  if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) f(r);
  } else {
    for (int64_t r = 0; r < rows; ++r) f(r);
  }
}

inline int64_t item_bytes(int dtype) { return dtype == kFloat32 ? 4 : 2; }

}  // namespace

extern "C" {

// The vector width, in bits, of the paths `simd` takes (512 AVX-512, 256 AVX2; 0: none built in,
// `simd` changes nothing).
int ce_cpu_sampler_simd() {
#if defined(CE_SAMPLER_AVX512)
  return 512;
#elif defined(CE_SAMPLER_AVX2)
  return 256;
#else
  return 0;
#endif
}

// out[r] = row r's argmax, rows `row_stride` elements apart, `n` values each with unit stride.
// `dtype` 0 float32, 1 bfloat16, 2 float16; `simd` 1 takes the AVX-512 or AVX2 path where built.
// Returns 0, or 1 for bad arguments (nothing written).
int ce_cpu_greedy(const void* logits, int64_t rows, int64_t n, int64_t row_stride, int dtype, int simd,
                  int num_threads, int64_t* out) {
  if (bad_sizes(rows, n, row_stride, dtype, num_threads)) return 1;
  for_rows(rows, n, num_threads, [&](int64_t r) {
    const void* row = static_cast<const char*>(logits) + r * row_stride * item_bytes(dtype);
#if defined(CE_SAMPLER_AVX512)
    if (simd != 0) {
      out[r] = pick_avx512(row, n, dtype);
      return;
    }
#elif defined(CE_SAMPLER_AVX2)
    if (simd != 0) {
      out[r] = pick_avx2(row, n, dtype);
      return;
    }
#endif
    (void)simd;
    out[r] = pick_portable(row, n, dtype);
  });
  return 0;
}

// out[r] = a draw from softmax(row r / temperature[r]) with uniform[r] in [0, 1) (see the
// header); rows laid out as for ce_cpu_greedy. A row with a NaN answers its argmax (its first
// NaN), a row of -inf answers 0. Returns 0, or 1 for bad arguments or a temperature that is not
// positive and finite (nothing written).
int ce_cpu_temperature_draw(const void* logits, int64_t rows, int64_t n, int64_t row_stride, int dtype,
                            const float* temperature, const float* uniform, int simd, int num_threads,
                            int64_t* out) {
  if (bad_sizes(rows, n, row_stride, dtype, num_threads)) return 1;
  for (int64_t r = 0; r < rows; ++r) {
    if (!(temperature[r] > 0.0f) || std::isinf(temperature[r])) return 1;
  }
  const int threads = team_size(rows, n, num_threads);
  // Each thread's scratch: a row's weights, then its groups' sums (draw_avx512, draw_avx2).
  const size_t per_thread = static_cast<size_t>(n + n / kGroup + 1);
  std::vector<float> scratch(static_cast<size_t>(threads) * per_thread);
  for_rows(rows, n, num_threads, [&](int64_t r) {
    const void* row = static_cast<const char*>(logits) + r * row_stride * item_bytes(dtype);
    int thread = 0;
#ifdef _OPENMP
    thread = threads > 1 ? omp_get_thread_num() : 0;
#endif
    float* weights = scratch.data() + static_cast<size_t>(thread) * per_thread;
#if defined(CE_SAMPLER_AVX512)
    if (simd != 0) {
      out[r] = draw_avx512(row, n, dtype, temperature[r], uniform[r], weights, weights + n);
      return;
    }
#elif defined(CE_SAMPLER_AVX2)
    if (simd != 0) {
      out[r] = draw_avx2(row, n, dtype, temperature[r], uniform[r], weights, weights + n);
      return;
    }
#endif
    (void)simd;
    out[r] = draw_portable(row, n, dtype, temperature[r], uniform[r], weights);
  });
  return 0;
}

}  // extern "C"
