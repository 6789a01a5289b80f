// The greedy pick for the CPU sampler: each row's argmax over the vocabulary, as torch's
// `logits.argmax(dim=-1)` answers it (the first index of the row's largest value; the first NaN
// where the row has one).
//
// Built at run time by kernels/cpu_attention_build.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes by kernels/cpu_greedy.py, which documents the contract.
//
// Why: torch's CPU `max(dim=-1)` (the sampler's route, faster than its argmax) went through
// bf16 logits at ~2 G values a second here, ~0.12 ms a step for 64 rows of a 4,000-token
// vocabulary and ~0.5 ms for 256 (docs/performance.md); two vector passes over a row held in L1
// (its maximum, then the first index holding it) do the same in a fraction of that.
//
// Paths (`simd`): 1 = AVX-512 (16 values a vector; bf16 widened by shifting its bits, fp16 with
// F16C) where the CPU has it, 0 = a plain loop. A row with a NaN takes the plain loop, which stops
// at the first NaN. Intrinsics sit in functions with `target` attributes, so the file builds on
// any x86-64 compiler whatever -march=native says.

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define CE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
#endif

namespace {

enum Dtype { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

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

#if defined(__x86_64__)
// Values i .. i + 15 of the row as floats.
CE_AVX512 inline __m512 load16(const void* row, int64_t i, int dtype) {
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

// pick_portable's answer in two passes of 16 values: the row's maximum (and whether it holds a
// NaN, which hands the row to pick_portable), then the first index equal to it.
CE_AVX512 int64_t pick_avx512(const void* row, int64_t n, int dtype) {
  const int64_t whole = n - n % 16;
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 v = load16(row, i, dtype);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  if (unordered != 0) return pick_portable(row, n, dtype);
  float best = _mm512_reduce_max_ps(top);
  for (int64_t i = whole; i < n; ++i) {
    const float v = load_one(row, i, dtype);
    if (std::isnan(v)) return pick_portable(row, n, dtype);
    if (v > best) best = v;
  }
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

bool has_avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }
#endif

// Rows of at least this many values in all are shared out over the threads: below it the
// threads' start-up costs more than the pick (64 rows of 4,000 take a few microseconds).
constexpr int64_t kParallelValues = int64_t{1} << 18;

}  // namespace

extern "C" {

// out[r] = the pick of row r, rows `row_stride` elements apart, `n` values each with unit stride.
// `dtype` 0 float32, 1 bfloat16, 2 float16; `simd` 1 takes the AVX-512 path where the CPU has it.
// Returns 0, or 1 for bad arguments.
int ce_cpu_greedy(const void* logits, int64_t rows, int64_t n, int64_t row_stride, int dtype, int simd,
                  int num_threads, int64_t* out) {
  if (rows < 0 || n < 1 || row_stride < n || dtype < 0 || dtype > 2 || num_threads < 1) return 1;
  const int64_t item = dtype == kFloat32 ? 4 : 2;
  bool vector = false;
#if defined(__x86_64__)
  vector = simd != 0 && has_avx512();
#endif
  auto pick_row = [&](int64_t r) {
    const void* row = static_cast<const char*>(logits) + r * row_stride * item;
#if defined(__x86_64__)
    if (vector) {
      out[r] = pick_avx512(row, n, dtype);
      return;
    }
#endif
    out[r] = pick_portable(row, n, dtype);
  };
  if (num_threads > 1 && rows > 1 && rows * n >= kParallelValues) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r) pick_row(r);
  } else {
    for (int64_t r = 0; r < rows; ++r) pick_row(r);
  }
  return 0;
}

}  // extern "C"
