// y = x W^T (+ b) for a few rows of x: a GEMV that streams a pre-packed weight once per call.
//
// Built at run time by kernels/cpu_attention_build.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes by kernels/cpu_gemv.py, which packs the weight and documents the contract.
//
// Why: with one to a few token rows a linear is bound by reading its weight; torch's bf16 linear
// at one row ran at a fraction of the machine's bandwidth, and Inductor's multiply-sum lowering
// reduces along the weight's rows one output at a time. Here the weight is re-laid out once so
// that each thread reads one contiguous stream, 64 output features at a time:
//
//   float32, float16:  packed[block][k][64]        (block = output feature / 64)
//   bfloat16:          packed[block][k / 2][64][2] (two consecutive k of one feature side by side)
//
// so every 64-byte load is 16 output features' worth of weights, multiplied by one broadcast x
// value (or, for bf16, one broadcast pair of x values with `vdpbf16ps`, which sums the pair into
// a float32 lane), and no horizontal sums are needed. Out-of-range features and the odd k of a
// bf16 weight are packed as zeros. Accumulation is float32 in every path.
//
// Paths (`isa`): 3 = AVX-512 BF16 (`_mm512_dpbf16_ps` for bf16 weights, else as 2); 2 = AVX-512F,
// bf16 widened to float32 by shifting its bits; 1 = AVX2 + FMA + F16C (the same maths 8 features a
// register, see the AVX2 section); 0 = plain C++ loops over the same layout. 4 = as 3, plus AMX
// tiles for bf16 weights and activations from 4 rows (the tile section says why and when).
// The caller picks the best this CPU has; tests force the others. Intrinsics sit in functions
// with `target` attributes, so the file builds on any x86-64 compiler whatever -march=native says.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu_amx.h"  // TileConfig, amx_permitted
#define CE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define CE_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))
#define CE_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kBlock = 64;  // output features per packed block
constexpr int kMaxRows = 4;     // rows per pass over a block (accumulators: 4 zmm per row)

enum Dtype { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float v) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float load_any(const void* p, int64_t i, int dtype) {
  switch (dtype) {
    case kFloat32: return static_cast<const float*>(p)[i];
    case kBFloat16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<float>(static_cast<const _Float16*>(p)[i]);
  }
}

inline void store_any(void* p, int64_t i, float v, int dtype) {
  switch (dtype) {
    case kFloat32: static_cast<float*>(p)[i] = v; break;
    case kBFloat16: static_cast<uint16_t*>(p)[i] = float_to_bf16(v); break;
    default: static_cast<_Float16*>(p)[i] = static_cast<_Float16>(v); break;
  }
}

struct Problem {
  const void* x;         // [rows, in_features], row stride x_stride elements, unit column stride
  int64_t x_stride;
  int64_t rows;
  const void* packed;    // see the header
  const void* bias;      // [out_features] or null
  void* out;             // [rows, out_features], contiguous
  int64_t in_features;
  int64_t out_features;
  int dtype;
  // x copied once, per row padded to k_padded: float32 for the float paths, bf16 pairs for dpbf16.
  const float* x_float;
  const uint16_t* x_bf16;
  int64_t k_padded;
};

// Finished sums of one block (acc[r][f], f < 64) -> out, with the bias, in the output dtype.
inline void finish_block(const Problem& p, int64_t block, int64_t row0, int nrows, const float* acc) {
  const int64_t first = block * kBlock;
  const int64_t count = std::min(kBlock, p.out_features - first);
  for (int r = 0; r < nrows; ++r) {
    void* out_row = static_cast<char*>(p.out) +
                    (row0 + r) * p.out_features * (p.dtype == kFloat32 ? 4 : 2);
    for (int64_t f = 0; f < count; ++f) {
      float v = acc[r * kBlock + f];
      if (p.bias != nullptr) v += load_any(p.bias, first + f, p.dtype);
      store_any(out_row, first + f, v, p.dtype);
    }
  }
}

// ---- portable path -------------------------------------------------------------------------

void block_portable(const Problem& p, int64_t block, int64_t row0, int nrows) {
  float acc[kMaxRows * kBlock] = {};
  const int64_t k_count = p.k_padded;
  if (p.dtype == kBFloat16) {
    const uint16_t* w = static_cast<const uint16_t*>(p.packed) + block * k_count * kBlock;
    for (int64_t k2 = 0; k2 < k_count / 2; ++k2) {
      const uint16_t* wk = w + k2 * kBlock * 2;
      for (int r = 0; r < nrows; ++r) {
        const float* xr = p.x_float + (row0 + r) * k_count + 2 * k2;
        for (int64_t f = 0; f < kBlock; ++f)
          acc[r * kBlock + f] += bf16_to_float(wk[2 * f]) * xr[0] + bf16_to_float(wk[2 * f + 1]) * xr[1];
      }
    }
  } else {
    for (int64_t k = 0; k < k_count; ++k) {
      for (int r = 0; r < nrows; ++r) {
        const float xv = p.x_float[(row0 + r) * k_count + k];
        if (p.dtype == kFloat32) {
          const float* wk = static_cast<const float*>(p.packed) + (block * k_count + k) * kBlock;
          for (int64_t f = 0; f < kBlock; ++f) acc[r * kBlock + f] += wk[f] * xv;
        } else {
          const _Float16* wk = static_cast<const _Float16*>(p.packed) + (block * k_count + k) * kBlock;
          for (int64_t f = 0; f < kBlock; ++f) acc[r * kBlock + f] += static_cast<float>(wk[f]) * xv;
        }
      }
    }
  }
  finish_block(p, block, row0, nrows, acc);
}

#if defined(__x86_64__)

// ---- AVX-512 paths -------------------------------------------------------------------------

template <int R>
CE_AVX512 inline void spill(__m512 (&acc)[R][4], float* out) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kBlock + 16 * j, acc[r][j]);
}

// float32 and float16 weights, packed[block][k][64]; x as float32.
template <int R, bool kHalf>
CE_AVX512 void block_avx512_float(const Problem& p, int64_t block, int64_t row0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t k_count = p.k_padded;
  const float* x0 = p.x_float + row0 * k_count;
  if constexpr (kHalf) {
    const uint16_t* w = static_cast<const uint16_t*>(p.packed) + block * k_count * kBlock;
    for (int64_t k = 0; k < k_count; ++k, w += kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kBlock), _MM_HINT_T0);
      __m512 wv[4];
      for (int j = 0; j < 4; ++j)
        wv[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j)));
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x0[r * k_count + k]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    }
  } else {
    const float* w = static_cast<const float*>(p.packed) + block * k_count * kBlock;
    for (int64_t k = 0; k < k_count; ++k, w += kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 8 * kBlock), _MM_HINT_T0);
      __m512 wv[4];
      for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_set1_ps(x0[r * k_count + k]);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    }
  }
  alignas(64) float sums[R * kBlock];
  spill<R>(acc, sums);
  finish_block(p, block, row0, R, sums);
}

// bfloat16 weights, packed[block][k/2][64][2], widened to float32: the even k of a pair is the low
// half of each 32-bit lane (shift it up), the odd k the high half (mask the low half off).
template <int R>
CE_AVX512 void block_avx512_bf16_widen(const Problem& p, int64_t block, int64_t row0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t k_count = p.k_padded;
  const float* x0 = p.x_float + row0 * k_count;
  const uint16_t* w = static_cast<const uint16_t*>(p.packed) + block * k_count * kBlock;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < k_count; k += 2, w += 2 * kBlock) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kBlock + 64), _MM_HINT_T0);
    __m512 even[4], odd[4];
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(w + 32 * j);
      even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      odd[j] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 xe = _mm512_set1_ps(x0[r * k_count + k]);
      const __m512 xo = _mm512_set1_ps(x0[r * k_count + k + 1]);
      for (int j = 0; j < 4; ++j) {
        acc[r][j] = _mm512_fmadd_ps(even[j], xe, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(odd[j], xo, acc[r][j]);
      }
    }
  }
  alignas(64) float sums[R * kBlock];
  spill<R>(acc, sums);
  finish_block(p, block, row0, R, sums);
}

// bfloat16 weights, packed[block][k/2][64][2], with `vdpbf16ps`: one broadcast pair of x per
// 32-bit lane, each lane summing its feature's two products into float32.
template <int R>
CE_AVX512BF16 void block_avx512_bf16_dot(const Problem& p, int64_t block, int64_t row0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t k_count = p.k_padded;
  const uint32_t* x0 = reinterpret_cast<const uint32_t*>(p.x_bf16 + row0 * k_count);
  const uint16_t* w = static_cast<const uint16_t*>(p.packed) + block * k_count * kBlock;
  for (int64_t k2 = 0; k2 < k_count / 2; ++k2, w += 2 * kBlock) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kBlock + 64), _MM_HINT_T0);
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + 32 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x0[r * (k_count / 2) + k2]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xv);
    }
  }
  alignas(64) float sums[R * kBlock];
  spill<R>(acc, sums);
  finish_block(p, block, row0, R, sums);
}

template <int R>
void block_avx512(const Problem& p, int64_t block, int64_t row0, int isa) {
  if (p.dtype == kBFloat16) {
    if (isa >= 3) block_avx512_bf16_dot<R>(p, block, row0);
    else block_avx512_bf16_widen<R>(p, block, row0);
  } else if (p.dtype == kFloat16) {
    block_avx512_float<R, true>(p, block, row0);
  } else {
    block_avx512_float<R, false>(p, block, row0);
  }
}

// ---- AVX2 paths ----------------------------------------------------------------------------
//
// The same layout and maths as the AVX-512 paths with 8 features a register. AVX2 has 16 ymm
// registers, not 32 zmm, so a block's 64 features cannot all stay in registers beside more than
// one row's sums: a pass covers NF registers (8 * NF features) of R rows (1 row: one pass of 8
// registers; 2-3 rows: two of 4; 4 rows: four of 2). The passes run over kChunkK input features
// at a time (at most 8 KB of the block), the sums going through L1 between chunks, so the block
// still streams from memory once, in order, and the passes after the first find it in L1.
constexpr int64_t kChunkK = 32;  // input features per chunk: even (bf16 pairs)

// The cache lines of `bytes` bytes at `at` into L1: a pass reads only its own columns of each k, a
// strided walk the hardware prefetcher follows poorly, so each pass asks for its columns of the
// next chunk itself.
inline void prefetch_lines(const void* at, int bytes) {
  for (int offset = 0; offset < bytes; offset += 64)
    _mm_prefetch(static_cast<const char*>(at) + offset, _MM_HINT_T0);
}

// float32 and float16 weights, packed[block][k][64]: inputs [k0, k1), features 8 * c0 ... of R rows,
// added to sums[r][f].
template <int R, int NF, bool kHalf>
CE_AVX2 void cols_avx2_float(const Problem& p, int64_t block, int64_t row0, int c0, int64_t k0, int64_t k1,
                             float* sums) {
  __m256 acc[R][NF];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_loadu_ps(sums + r * kBlock + 8 * (c0 + j));
  const int64_t k_count = p.k_padded;
  const float* x0 = p.x_float + row0 * k_count;
  if constexpr (kHalf) {
    const uint16_t* w = static_cast<const uint16_t*>(p.packed) + (block * k_count + k0) * kBlock + 8 * c0;
    for (int64_t k = k0; k < k1; ++k, w += kBlock) {
      prefetch_lines(w + kChunkK * kBlock, 16 * NF);
      __m256 wv[NF];
      for (int j = 0; j < NF; ++j)
        wv[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * j)));
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x0 + r * k_count + k);
        for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    }
  } else {
    const float* w = static_cast<const float*>(p.packed) + (block * k_count + k0) * kBlock + 8 * c0;
    for (int64_t k = k0; k < k1; ++k, w += kBlock) {
      prefetch_lines(w + kChunkK * kBlock, 32 * NF);
      for (int j = 0; j < NF; ++j) {
        const __m256 wv = _mm256_loadu_ps(w + 8 * j);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv, _mm256_broadcast_ss(x0 + r * k_count + k), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) _mm256_storeu_ps(sums + r * kBlock + 8 * (c0 + j), acc[r][j]);
}

// bfloat16 weights, packed[block][k/2][64][2], widened as block_avx512_bf16_widen does.
template <int R, int NF>
CE_AVX2 void cols_avx2_bf16(const Problem& p, int64_t block, int64_t row0, int c0, int64_t k0, int64_t k1,
                            float* sums) {
  __m256 acc[R][NF];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_loadu_ps(sums + r * kBlock + 8 * (c0 + j));
  const int64_t k_count = p.k_padded;
  const float* x0 = p.x_float + row0 * k_count;
  const uint16_t* w = static_cast<const uint16_t*>(p.packed) + (block * k_count + k0) * kBlock + 16 * c0;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = k0; k < k1; k += 2, w += 2 * kBlock) {
    prefetch_lines(w + kChunkK * kBlock, 32 * NF);
    for (int j = 0; j < NF; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x0 + r * k_count + k), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x0 + r * k_count + k + 1), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) _mm256_storeu_ps(sums + r * kBlock + 8 * (c0 + j), acc[r][j]);
}

using AvxCols = void (*)(const Problem&, int64_t, int64_t, int, int64_t, int64_t, float*);

// One block of R rows: chunk by chunk, 8 / NF passes of `cols` each; then the bias and the dtype.
template <int R, int NF>
void block_avx2_passes(const Problem& p, int64_t block, int64_t row0, AvxCols cols) {
  alignas(32) float sums[R * kBlock] = {};
  for (int64_t k0 = 0; k0 < p.k_padded; k0 += kChunkK) {
    const int64_t k1 = std::min(k0 + kChunkK, p.k_padded);
    for (int c0 = 0; c0 < 8; c0 += NF) cols(p, block, row0, c0, k0, k1, sums);
  }
  finish_block(p, block, row0, R, sums);
}

template <int R, int NF>
void block_avx2(const Problem& p, int64_t block, int64_t row0) {
  if (p.dtype == kBFloat16) block_avx2_passes<R, NF>(p, block, row0, cols_avx2_bf16<R, NF>);
  else if (p.dtype == kFloat16) block_avx2_passes<R, NF>(p, block, row0, cols_avx2_float<R, NF, true>);
  else block_avx2_passes<R, NF>(p, block, row0, cols_avx2_float<R, NF, false>);
}

// ---- AVX2, many rows: register tiles -------------------------------------------------------
//
// Past a few rows the multiply-adds, not the weight's bytes, are the cost, and the passes above
// spend one broadcast of x per multiply-add (each register of weights meets every row before the
// next register is loaded, and 16 ymm cannot hold the broadcasts between them): ~50 GFLOP/s on a
// Zen 3 whose fp32 GEMM reaches ~140. Here a pass holds kWideRows x kWideCols registers of sums
// over all of K: each k's weight registers are widened once and meet the rows, one broadcast
// each, so a broadcast feeds kWideCols multiply-adds (6 rows x 16 features: 12 sums, 2 weights, 1
// broadcast = 15 ymm; 4 rows x 24 left the compiler no register for a load and it spilled the
// sums every k). bf16 pairs are widened even k first (shifted), then odd k (reloaded from L1 and
// masked), so the two never need registers at once. The block's weights come from memory for its
// first rows and from L2 for the rest (a block of 64 features is 128 bytes a k: 180 KB at K =
// 1,408). bench/test_widened_linear.py times it on bench-small's linears (docs/performance.md).
constexpr int kWideRows = 6;         // rows of a register tile
constexpr int kWideCols = 2;         // ymm registers of features (16 features)
constexpr int64_t kWideMinRows = 8;  // from here the AVX2 path runs register tiles (fewer: passes)

// acc[r][j] += w[j] * x[r * stride] for a tile's R rows: one broadcast a row, NF multiply-adds.
template <int R, int NF>
CE_AVX2 inline void tile_fmadd(__m256 (&acc)[R][NF], const __m256 (&w)[NF], const float* x, int64_t stride) {
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * stride);
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_fmadd_ps(w[j], xv, acc[r][j]);
  }
}

// A tile's sums into sums[r][8 * c0 ...] (every sum of the pass: the tile covers all of K).
template <int R, int NF>
CE_AVX2 inline void tile_store(const __m256 (&acc)[R][NF], int c0, float* sums) {
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) _mm256_storeu_ps(sums + r * kBlock + 8 * (c0 + j), acc[r][j]);
}

template <int R, int NF>
CE_AVX2 void wide_avx2_bf16(const Problem& p, int64_t block, int64_t row0, int c0, float* sums) {
  __m256 acc[R][NF];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t k_count = p.k_padded;
  const float* x0 = p.x_float + row0 * k_count;
  const uint16_t* w = static_cast<const uint16_t*>(p.packed) + block * k_count * kBlock + 16 * c0;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t k = 0; k < k_count; k += 2, w += 2 * kBlock) {
    __m256 wv[NF];
    for (int j = 0; j < NF; ++j)
      wv[j] = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j)), 16));
    tile_fmadd<R, NF>(acc, wv, x0 + k, k_count);
    for (int j = 0; j < NF; ++j)  // the odd k: the pair's high half, its low half cleared
      wv[j] = _mm256_castsi256_ps(
          _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * j)), high));
    tile_fmadd<R, NF>(acc, wv, x0 + k + 1, k_count);
  }
  tile_store<R, NF>(acc, c0, sums);
}

template <int R, int NF, bool kHalf>
CE_AVX2 void wide_avx2_float(const Problem& p, int64_t block, int64_t row0, int c0, float* sums) {
  __m256 acc[R][NF];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t k_count = p.k_padded;
  const float* x0 = p.x_float + row0 * k_count;
  for (int64_t k = 0; k < k_count; ++k) {
    __m256 wv[NF];
    if constexpr (kHalf) {
      const uint16_t* w = static_cast<const uint16_t*>(p.packed) + (block * k_count + k) * kBlock + 8 * c0;
      for (int j = 0; j < NF; ++j)
        wv[j] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 8 * j)));
    } else {
      const float* w = static_cast<const float*>(p.packed) + (block * k_count + k) * kBlock + 8 * c0;
      for (int j = 0; j < NF; ++j) wv[j] = _mm256_loadu_ps(w + 8 * j);
    }
    tile_fmadd<R, NF>(acc, wv, x0 + k, k_count);
  }
  tile_store<R, NF>(acc, c0, sums);
}

// One block of kWideRows rows: passes of kWideCols registers, then the bias and the dtype.
void block_avx2_wide(const Problem& p, int64_t block, int64_t row0) {
  alignas(32) float sums[kWideRows * kBlock];
  for (int c0 = 0; c0 < 8; c0 += kWideCols) {
    if (p.dtype == kBFloat16) wide_avx2_bf16<kWideRows, kWideCols>(p, block, row0, c0, sums);
    else if (p.dtype == kFloat16) wide_avx2_float<kWideRows, kWideCols, true>(p, block, row0, c0, sums);
    else wide_avx2_float<kWideRows, kWideCols, false>(p, block, row0, c0, sums);
  }
  finish_block(p, block, row0, kWideRows, sums);
}

#endif

void run_block(const Problem& p, int64_t block, int64_t row0, int nrows, int isa) {
#if defined(__x86_64__)
  if (isa >= 2) {
    switch (nrows) {
      case 1: return block_avx512<1>(p, block, row0, isa);
      case 2: return block_avx512<2>(p, block, row0, isa);
      case 3: return block_avx512<3>(p, block, row0, isa);
      default: return block_avx512<4>(p, block, row0, isa);
    }
  }
  if (isa == 1) {
    switch (nrows) {
      case 1: return block_avx2<1, 8>(p, block, row0);
      case 2: return block_avx2<2, 4>(p, block, row0);
      case 3: return block_avx2<3, 4>(p, block, row0);
      default: return block_avx2<4, 2>(p, block, row0);
    }
  }
#endif
  block_portable(p, block, row0, nrows);
}

// ---- AMX tiles: bf16 from 4 rows -------------------------------------------------------------
//
// Past one row the GEMV's multiply-adds, not its bytes, are the cost: vdpbf16ps does 32 of them
// an instruction per row, so 8 rows took ~6x one row's time on the embedded model's LM head
// (bench/test_gemv_rows.py, docs/performance.md), where each weight is still read once. A
// TDPBF16PS does 16 rows x 32 inputs x 16 outputs, so 16 rows cost about what 4 do. The packed
// bf16 layout is already the B tile's (pairs of inputs per output, [k/2][64][2]): B tiles (16
// input pairs x 16 outputs each) load straight from it with a 256-byte stride. The A tiles are the
// rows' bf16 activations, padded with zero rows to whole tiles. Up to 16 rows, one A tile meets a
// step's four B tiles (block_tiles_16); past 16, 32 rows at a time meet half a block's outputs,
// two A and two B tiles a step into four C tiles (block_tiles_32): a tile load per multiply, where
// one A and four B tiles make five loads per four. Each block of 64 outputs runs all its rows
// before the next, so its weights come from memory once and from L2 after. Inputs must come in
// whole steps of 32 (so no tile reads past a block's inputs), which real models' widths are; other
// shapes and float32 / float16 keep the paths above.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CE_GEMV_AMX 1
#define CE_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

constexpr int64_t kTileK = 32;     // inputs per tile step
constexpr int64_t kTileRows = 16;  // rows of an A tile
// Fewer rows keep the dot path: a call's fixed tile cost (the configuration, zeroing and storing
// four C tiles a block) is not repaid at 2 rows (a scratch timing of the embedded model's
// linears); at 4 the tiles won on each (bench/test_gemv_rows.py).
constexpr int64_t kMinTileRows = 4;

using ce_amx::amx_permitted;
using ce_amx::TileConfig;

// finish_block for the tile path (bf16 outputs), 16 outputs a vector: the scalar one, at a few
// nanoseconds an output, cost more than the tiles' multiply-adds at 16 rows.
CE_AMX void finish_block_bf16(const Problem& p, int64_t block, int64_t row0, int nrows, const float* acc) {
  const int64_t first = block * kBlock;
  const int64_t count = std::min(kBlock, p.out_features - first);
  for (int r = 0; r < nrows; ++r) {
    uint16_t* out_row = static_cast<uint16_t*>(p.out) + (row0 + r) * p.out_features + first;
    for (int64_t f = 0; f < count; f += 16) {
      const __mmask16 mask = count - f >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - f)) - 1);
      __m512 v = _mm512_loadu_ps(acc + r * kBlock + f);
      if (p.bias != nullptr) {
        const __m256i b = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p.bias) + first + f);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      _mm256_mask_storeu_epi16(out_row + f, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

// One block of 64 outputs for 16 rows (one A tile) from `row0`: C0..C3 (16 outputs each) += A x B
// over the inputs.
CE_AMX void block_tiles_16(const Problem& p, const uint16_t* x_tiles, int64_t block, int64_t row0) {
  const int64_t k_count = p.k_padded;
  const uint16_t* w = static_cast<const uint16_t*>(p.packed) + block * k_count * kBlock;
  constexpr int64_t kRowBytes = 2 * kBlock * 2;  // one input pair of the block: 64 outputs x 2 bf16
  const uint16_t* a = x_tiles + row0 * k_count;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < k_count; k0 += kTileK) {
    const uint16_t* b = w + (k0 / 2) * 2 * kBlock;  // this step's 16 input pairs
    _tile_loadd(4, a + k0, k_count * 2);
    _tile_loadd(5, b, kRowBytes);
    _tile_loadd(6, b + 32, kRowBytes);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, b + 64, kRowBytes);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 96, kRowBytes);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  alignas(64) float sums[kTileRows * kBlock];
  _tile_stored(0, sums, kBlock * 4);
  _tile_stored(1, sums + 16, kBlock * 4);
  _tile_stored(2, sums + 32, kBlock * 4);
  _tile_stored(3, sums + 48, kBlock * 4);
  finish_block_bf16(p, block, row0, static_cast<int>(std::min<int64_t>(kTileRows, p.rows - row0)), sums);
}

// 32 rows x 32 outputs (half `half` of a block) from `row0`: C0 = rows 0-15 x outputs 0-15, C1 =
// rows 0-15 x 16-31, C2, C3 the next 16 rows; two A and two B tiles a step.
CE_AMX void block_tiles_32(const Problem& p, const uint16_t* x_tiles, int64_t block, int64_t row0, int half,
                           float* sums) {
  const int64_t k_count = p.k_padded;
  const uint16_t* w = static_cast<const uint16_t*>(p.packed) + block * k_count * kBlock + half * 64;
  constexpr int64_t kRowBytes = 2 * kBlock * 2;
  const uint16_t* a0 = x_tiles + row0 * k_count;
  const uint16_t* a1 = a0 + kTileRows * k_count;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < k_count; k0 += kTileK) {
    const uint16_t* b = w + (k0 / 2) * 2 * kBlock;
    _tile_loadd(4, a0 + k0, k_count * 2);
    _tile_loadd(6, b, kRowBytes);
    _tile_loadd(7, b + 32, kRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a1 + k0, k_count * 2);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  // sums: [32 rows][64 outputs]; this half's 32 outputs.
  _tile_stored(0, sums + half * 32, kBlock * 4);
  _tile_stored(1, sums + half * 32 + 16, kBlock * 4);
  _tile_stored(2, sums + kTileRows * kBlock + half * 32, kBlock * 4);
  _tile_stored(3, sums + kTileRows * kBlock + half * 32 + 16, kBlock * 4);
}

// One block of 64 outputs for every row: 32 rows at a time, both halves of the block
// (block_tiles_32; the last 32 may run into the zero rows that pad x to whole 32s), and 16 or
// fewer rows past whole 32s on one A tile (block_tiles_16). (Each half block for 64 rows before
// the other half, to meet its weights in L1 the second time, measured no faster.)
CE_AMX void block_tiles(const Problem& p, const uint16_t* x_tiles, int64_t block) {
  int64_t row0 = 0;
  for (; p.rows - row0 > kTileRows; row0 += 2 * kTileRows) {
    alignas(64) float sums[2 * kTileRows * kBlock];
    block_tiles_32(p, x_tiles, block, row0, 0, sums);
    block_tiles_32(p, x_tiles, block, row0, 1, sums);
    finish_block_bf16(p, block, row0, static_cast<int>(std::min<int64_t>(2 * kTileRows, p.rows - row0)), sums);
  }
  if (row0 < p.rows) block_tiles_16(p, x_tiles, block, row0);
}

CE_AMX void run_tiles(const Problem& p, const uint16_t* x_tiles, int64_t blocks, int threads) {
#pragma omp parallel num_threads(threads)
  {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = kTileRows;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) block_tiles(p, x_tiles, block);
    _tile_release();
  }
}
#endif

}  // namespace

extern "C" {

// Returns 0, or 1 for bad arguments. `isa` as in the header (the caller checked the CPU has it).
int ce_cpu_gemv(const void* x, int64_t x_stride, int64_t rows, const void* packed, const void* bias, void* out,
                int64_t in_features, int64_t out_features, int dtype, int isa, int num_threads) {
  if (rows < 0 || in_features < 1 || out_features < 1 || dtype < 0 || dtype > 2) return 1;
  if (rows == 0) return 0;
  const int64_t k_padded = in_features + (in_features & 1);
  // x once, padded with a zero k where in_features is odd: float32 for the float paths, bf16
  // (the pairs vdpbf16ps broadcasts) for the dot path.
  const bool dot = dtype == kBFloat16 && isa >= 3;
#ifdef CE_GEMV_AMX
  const bool tiles = dot && isa >= 4 && rows >= kMinTileRows && in_features % kTileK == 0 && amx_permitted();
  // The tile path's A tiles are whole: 16 rows, or past 16 whole 32s (zero rows past `rows`); the
  // others take `rows`.
  const int64_t x_rows = !tiles ? rows
                         : rows <= kTileRows ? kTileRows
                                             : (rows + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows);
#else
  const int64_t x_rows = rows;
#endif
  std::vector<float> x_float(dot ? 0 : rows * k_padded, 0.0f);
  std::vector<uint16_t> x_bf16(dot ? x_rows * k_padded : 0, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = static_cast<const char*>(x) + r * x_stride * (dtype == kFloat32 ? 4 : 2);
    if (dot) std::memcpy(x_bf16.data() + r * k_padded, row, in_features * 2);
    else
      for (int64_t k = 0; k < in_features; ++k) x_float[r * k_padded + k] = load_any(row, k, dtype);
  }
  Problem p{x, x_stride, rows, packed, bias, out, in_features, out_features, dtype,
            x_float.data(), x_bf16.data(), k_padded};
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
#ifdef CE_GEMV_AMX
  if (tiles) {
    run_tiles(p, x_bf16.data(), blocks, threads);
    return 0;
  }
#endif
#if defined(__x86_64__)
  if (isa == 1 && rows >= kWideMinRows) {  // AVX2: register tiles, then the rows left over
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block < blocks; ++block) {
      int64_t row0 = 0;
      for (; row0 + kWideRows <= rows; row0 += kWideRows) block_avx2_wide(p, block, row0);
      if (row0 < rows) run_block(p, block, row0, static_cast<int>(rows - row0), isa);
    }
    return 0;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows)
      run_block(p, block, row0, static_cast<int>(std::min<int64_t>(kMaxRows, rows - row0)), isa);
  return 0;
}

// 1 when the tile path is built in (a compiler and -march with AMX) and Linux grants the tile
// state to this process, else 0: then isa 4 runs as 3.
int ce_cpu_gemv_tiles_available() {
#ifdef CE_GEMV_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

}  // extern "C"
