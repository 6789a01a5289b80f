// y = x dequant(W)^T (+ b) for a few rows of x, W int8 (a scale per output feature) or int4 (a scale
// and zero per group of input features): the C++ GEMV of kernels/cpu_gemv.cpp over quantized weights.
//
// Built at run time by kernels/cpu_attention_build.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes by kernels/cpu_gemv_quantized.py, which packs the weights and documents the contract.
//
// Why: one-token decode is a read of every weight; int8 halves the bytes of bf16 and int4 quarters
// them, so a kernel that streams the packed integers once, on every core, and widens them in
// registers is bound by those fewer bytes. Layouts (64 output features side by side, as cpu_gemv.cpp):
//
//   int8:  packed[block][k][64]       int8               scales[block][64]         float32
//   int4:  packed[block][k / 2][64]   uint8: k even in the low nibble, k odd in the high one,
//                                     values 0..15
//          scales[block][group][64], offsets[block][group][64]  float32, w = q * scale + offset
//          and, where the model's scales and zeros are bf16, scale_zero[block][group][64] uint32:
//          bf16 scale | bf16 zero << 16, the same values in half the bytes (offset = zero - 8 scale)
//
// (offset = zero - 8 * scale folds torch's "q - 8" into one multiply-add.) Features past
// out_features are packed as zeros. int4 sums q * x per group in float32, then adds
// scale * that sum + offset * (sum of the group's x). Accumulation is float32 in every path.
//
// Paths (`isa`, numbered as kernels/cpu_gemv.cpp's): >= 2 = AVX-512F (the integers widened with
// vpmovsxbd / vpmovzxbd; VNNI where the build has it, see below), 1 = AVX2 + FMA (the same widening
// 8 features a register; for bf16 / fp16 x, integer vpmaddwd loops), 0 = plain C++ loops over the
// same layout. The caller picks the best this
// CPU has; tests force the others. The many-rows entry points (ce_cpu_gemm_*) add the AMX tile path
// (4) and, on AVX2 from 8 rows, a path that widens each block once per call (to int16 for bf16 /
// fp16 x, dequantized to float32 otherwise; the AVX2 section says why), int4's with x rounded to
// int8 per 32 inputs for bf16 / fp16 x (many_rows_block_quads).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu_amx.h"  // TileConfig, amx_permitted
#define CE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define CE_AVX2 __attribute__((target("avx2,fma,f16c")))
#endif

namespace {

constexpr int64_t kBlock = 64;  // output features per packed block
constexpr int kMaxRows = 4;     // rows per pass over a block

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
  const float* x;        // [rows, in_features] as float32, contiguous
  const float* x_sums;   // int4: [rows, groups] sums of x per group
  const int16_t* x16;    // with VNNI: [rows, in_features] x in int16 per chunk (int8) or group (int4)
  const float* x16_scales;  // ... and each chunk's scale, [rows, chunks]
  int64_t rows;
  const void* packed;
  const float* scales;
  const float* offsets;  // int4 only
  int64_t group_size;    // int4 only
  const void* bias;      // [out_features] in the output dtype, or null
  void* out;             // [rows, out_features], contiguous, in `dtype`
  int64_t in_features;
  int64_t out_features;
  int dtype;
  // int4 with bf16 scales and zeros: [block][group][64] uint32, the scale's bf16 bits in the low
  // half and the zero's in the high one (w = (q - 8) * scale + zero), or null. The AVX-512 paths
  // and AVX2's integer ones read these (4 bytes a group and output, not the float32 scales' and
  // offsets' 8: int4 at group 32 then streams 0.625 bytes a weight, not 0.75); the others read
  // the float32 arrays.
  const uint32_t* scale_zero = nullptr;
  // int4 many rows on AVX2 (many_rows_block_quads): x in int8 per 32 inputs, [rows, in_features],
  // and each 32's scale, [rows, in_features / 32]; or null.
  const int8_t* x8 = nullptr;
  const float* x8_scales = nullptr;
};

// x in int16 (the integer paths: bf16 / fp16 activations, even in_features): x16 = round(x / s)
// with s = max|x| / 32767 per kX16Chunk input features of a row (int8) or per quantization group
// (int4), so an outlier costs precision in its own chunk only, and the rounding (2^-16 of the
// chunk's largest value) stays well below the bf16 / fp16 rounding x arrived with. Sums are int32:
// int8 |sum| <= 2 * 32767 * 128 * 128 < 2^31 over a chunk; int4 (nibbles 0..15) stays below 2^31
// for groups up to kMaxX16Group input features, wider groups take the float paths.
constexpr int64_t kX16Chunk = 256;
constexpr int64_t kMaxX16Group = 4096;
// Packed rows (64 bytes each) the integer loops ask for ahead of use: 8 KB. At one row the loops
// are a stream from memory; 16 rows (1 KB) ahead left the VNNI ones ~13 % slower than this (0.5B
// shape's linears, one thread, Zen 4: int8 18.9 -> 16.4 ms, int4 12.1 -> 10.7 ms; 64 and 256 rows
// ahead alike).
constexpr int64_t kX16PrefetchRows = 128;

inline void finish_block(const Problem& p, int64_t block, int64_t row0, int nrows, const float* acc,
                         bool scaled) {
  const int64_t first = block * kBlock;
  const int64_t count = std::min(kBlock, p.out_features - first);
  const float* scales = p.scales + block * kBlock;
  for (int r = 0; r < nrows; ++r) {
    void* out_row = static_cast<char*>(p.out) + (row0 + r) * p.out_features * (p.dtype == kFloat32 ? 4 : 2);
    for (int64_t f = 0; f < count; ++f) {
      float v = acc[r * kBlock + f];
      if (scaled) v *= scales[f];
      if (p.bias != nullptr) v += load_any(p.bias, first + f, p.dtype);
      store_any(out_row, first + f, v, p.dtype);
    }
  }
}

// ---- portable paths ------------------------------------------------------------------------

void int8_block_portable(const Problem& p, int64_t block, int64_t row0, int nrows) {
  float acc[kMaxRows * kBlock] = {};
  const int8_t* w = static_cast<const int8_t*>(p.packed) + block * p.in_features * kBlock;
  for (int64_t k = 0; k < p.in_features; ++k, w += kBlock)
    for (int r = 0; r < nrows; ++r) {
      const float xv = p.x[(row0 + r) * p.in_features + k];
      for (int64_t f = 0; f < kBlock; ++f) acc[r * kBlock + f] += static_cast<float>(w[f]) * xv;
    }
  finish_block(p, block, row0, nrows, acc, true);
}

void int4_block_portable(const Problem& p, int64_t block, int64_t row0, int nrows) {
  float acc[kMaxRows * kBlock] = {};
  const int64_t groups = p.in_features / p.group_size;
  const uint8_t* w = static_cast<const uint8_t*>(p.packed) + block * (p.in_features / 2) * kBlock;
  for (int64_t g = 0; g < groups; ++g) {
    const float* scales = p.scales + (block * groups + g) * kBlock;
    const float* offsets = p.offsets + (block * groups + g) * kBlock;
    for (int r = 0; r < nrows; ++r) {
      float sums[kBlock] = {};
      const float* x = p.x + (row0 + r) * p.in_features + g * p.group_size;
      const uint8_t* wg = w + g * (p.group_size / 2) * kBlock;
      for (int64_t kk = 0; kk < p.group_size / 2; ++kk) {
        const uint8_t* wk = wg + kk * kBlock;
        for (int64_t f = 0; f < kBlock; ++f)
          sums[f] += static_cast<float>(wk[f] & 0x0F) * x[2 * kk] + static_cast<float>(wk[f] >> 4) * x[2 * kk + 1];
      }
      const float x_sum = p.x_sums[(row0 + r) * groups + g];
      for (int64_t f = 0; f < kBlock; ++f) acc[r * kBlock + f] += sums[f] * scales[f] + offsets[f] * x_sum;
    }
  }
  finish_block(p, block, row0, nrows, acc, false);
}

#if defined(__x86_64__)

// ---- AVX-512 paths -------------------------------------------------------------------------

template <int R>
CE_AVX512 void int8_block_avx512(const Problem& p, int64_t block, int64_t row0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t k_count = p.in_features;
  const float* x0 = p.x + row0 * k_count;
  const int8_t* w = static_cast<const int8_t*>(p.packed) + block * k_count * kBlock;
  for (int64_t k = 0; k < k_count; ++k, w += kBlock) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kBlock), _MM_HINT_T0);
    __m512 wv[4];
    for (int j = 0; j < 4; ++j)
      wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j))));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x0[r * k_count + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_ps(wv[j], xv, acc[r][j]);
    }
  }
  alignas(64) float sums[R * kBlock];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(sums + r * kBlock + 16 * j, acc[r][j]);
  finish_block(p, block, row0, R, sums, true);
}

template <int R>
CE_AVX512 void int4_block_avx512(const Problem& p, int64_t block, int64_t row0) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t k_count = p.in_features;
  const int64_t groups = k_count / p.group_size;
  const float* x0 = p.x + row0 * k_count;
  const uint8_t* w = static_cast<const uint8_t*>(p.packed) + block * (k_count / 2) * kBlock;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 sums[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) sums[r][j] = _mm512_setzero_ps();
    const int64_t k_first = g * p.group_size;
    for (int64_t k = k_first; k < k_first + p.group_size; k += 2, w += kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(w + 16 * kBlock), _MM_HINT_T0);
      __m512 even[4], odd[4];
      for (int j = 0; j < 4; ++j) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j));
        even[j] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low_mask)));
        odd[j] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low_mask)));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xe = _mm512_set1_ps(x0[r * k_count + k]);
        const __m512 xo = _mm512_set1_ps(x0[r * k_count + k + 1]);
        for (int j = 0; j < 4; ++j) {
          sums[r][j] = _mm512_fmadd_ps(even[j], xe, sums[r][j]);
          sums[r][j] = _mm512_fmadd_ps(odd[j], xo, sums[r][j]);
        }
      }
    }
    const float* scales = p.scales + (block * groups + g) * kBlock;
    const float* offsets = p.offsets + (block * groups + g) * kBlock;
    for (int j = 0; j < 4; ++j) {
      const __m512 scale = _mm512_loadu_ps(scales + 16 * j);
      const __m512 offset = _mm512_loadu_ps(offsets + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512 x_sum = _mm512_set1_ps(p.x_sums[(row0 + r) * groups + g]);
        acc[r][j] = _mm512_fmadd_ps(sums[r][j], scale, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(offset, x_sum, acc[r][j]);
      }
    }
  }
  alignas(64) float out[R * kBlock];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * kBlock + 16 * j, acc[r][j]);
  finish_block(p, block, row0, R, out, false);
}

#if defined(__AVX512VNNI__)
#define CE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

// int8 weights against x in int16 (Problem::x16, see kX16Chunk): vpdpwssd sums two input features
// of 16 output features an instruction in int32 (rows k and k + 1 interleaved word by word),
// against 4 widenings, conversions and multiply-adds each in float: the float path's
// instructions, not the bytes, bounded it at the MLP's shapes.

template <int R>
CE_VNNI void int8_block_vnni(const Problem& p, int64_t block, int64_t row0) {
  const int64_t k_count = p.in_features;
  const int64_t chunks = (k_count + kX16Chunk - 1) / kX16Chunk;
  const int8_t* w = static_cast<const int8_t*>(p.packed) + block * k_count * kBlock;
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t k_end = std::min(k_count, (chunk + 1) * kX16Chunk);
    __m512i sums[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) sums[r][c] = _mm512_setzero_si512();
    for (int64_t k = chunk * kX16Chunk; k < k_end; k += 2, w += 2 * kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kX16PrefetchRows * kBlock), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kX16PrefetchRows + 1) * kBlock), _MM_HINT_T0);
      const __m512i a0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
      const __m512i a1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)));
      const __m512i b0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlock)));
      const __m512i b1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlock + 32)));
      const __m512i pairs[4] = {_mm512_unpacklo_epi16(a0, b0), _mm512_unpackhi_epi16(a0, b0),
                                _mm512_unpacklo_epi16(a1, b1), _mm512_unpackhi_epi16(a1, b1)};
      for (int r = 0; r < R; ++r) {
        int32_t xk;
        std::memcpy(&xk, p.x16 + (row0 + r) * k_count + k, sizeof xk);
        const __m512i xv = _mm512_set1_epi32(xk);
        for (int c = 0; c < 4; ++c) sums[r][c] = _mm512_dpwssd_epi32(sums[r][c], pairs[c], xv);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(p.x16_scales[(row0 + r) * chunks + chunk]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][c]), scale, acc[r][c]);
    }
  }
  // pairs[2h] lane 4L + m holds feature 32h + 8L + m, pairs[2h + 1] lane 4L + m feature 32h + 8L + 4 + m.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  alignas(64) float out[R * kBlock];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      _mm512_storeu_ps(out + r * kBlock + 32 * h, _mm512_permutex2var_ps(acc[r][2 * h], first, acc[r][2 * h + 1]));
      _mm512_storeu_ps(out + r * kBlock + 32 * h + 16,
                       _mm512_permutex2var_ps(acc[r][2 * h], second, acc[r][2 * h + 1]));
    }
  finish_block(p, block, row0, R, out, true);
}

// int4 the same way, x in int16 per quantization group (x16_scales [rows, groups]): each byte's two
// nibbles (input features k and k + 1 of one output feature) spread into the two halves of a 32-bit
// lane, so vpdpwssd takes a pair of input features of 16 outputs an instruction; the group's scale
// and offset then apply once, as in the float path.
// 16 outputs' scale and offset of a group (`at`: [block][group][64] index), from scale_zero where
// the weight has it, else the float32 arrays.
CE_AVX512 inline void group_scale_offset(const Problem& p, int64_t at, __m512& scale, __m512& offset) {
  if (p.scale_zero != nullptr) {
    const __m512i v = _mm512_loadu_si512(p.scale_zero + at);
    scale = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), scale, zero);  // zero - 8 scale, rounded once as the packer's
  } else {
    scale = _mm512_loadu_ps(p.scales + at);
    offset = _mm512_loadu_ps(p.offsets + at);
  }
}

template <int R>
CE_VNNI void int4_block_vnni(const Problem& p, int64_t block, int64_t row0) {
  const int64_t k_count = p.in_features;
  const int64_t groups = k_count / p.group_size;
  const uint8_t* w = static_cast<const uint8_t*>(p.packed) + block * (k_count / 2) * kBlock;
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i sums[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) sums[r][c] = _mm512_setzero_si512();
    const int64_t k_first = g * p.group_size;
    for (int64_t k = k_first; k < k_first + p.group_size; k += 2, w += kBlock) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kX16PrefetchRows * kBlock), _MM_HINT_T0);
      __m512i pairs[4];
      for (int c = 0; c < 4; ++c) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
        // (b | b << 12) & 0x000F000F: the low nibble in bits 0-3, the high one in bits 16-19.
        pairs[c] = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), nibbles, 0xA8);
      }
      for (int r = 0; r < R; ++r) {
        int32_t xk;
        std::memcpy(&xk, p.x16 + (row0 + r) * k_count + k, sizeof xk);
        const __m512i xv = _mm512_set1_epi32(xk);
        for (int c = 0; c < 4; ++c) sums[r][c] = _mm512_dpwssd_epi32(sums[r][c], pairs[c], xv);
      }
    }
    for (int c = 0; c < 4; ++c) {
      __m512 scale, offset;
      group_scale_offset(p, (block * groups + g) * kBlock + 16 * c, scale, offset);
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(p.x16_scales[(row0 + r) * groups + g]);
        const __m512 x_sum = _mm512_set1_ps(p.x_sums[(row0 + r) * groups + g]);
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][c]), _mm512_mul_ps(scale, xs), acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(offset, x_sum, acc[r][c]);
      }
    }
  }
  alignas(64) float out[R * kBlock];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + r * kBlock + 16 * c, acc[r][c]);
  finish_block(p, block, row0, R, out, false);
}
#endif

// ---- AVX2 paths ----------------------------------------------------------------------------
//
// The GEMV: as the AVX-512 paths, 8 features a register, organised as kernels/cpu_gemv.cpp's AVX2
// paths: a pass covers NF registers (8 * NF features) of R rows, a block takes 8 / NF passes per
// chunk of input features (int8: kGemvChunkK of them, 4 KB; int4: one quantization group), and
// the sums go through L1 between chunks, so the integers stream from memory once, in order. int8
// sums q * x and scales in finish_block; int4 sums a group's q * x in registers, then folds in the
// group's scale and offset. Each k's 64 bytes are one cache line, which the first pass asks for a
// chunk ahead (the later passes read the same lines, then in L1).
constexpr int64_t kGemvChunkK = 64;

// int8, packed[block][k][64]: inputs [k0, k1), q * x added to sums[r][8 * c0 ...].
template <int R, int NF>
CE_AVX2 void int8_cols_avx2(const Problem& p, int64_t block, int64_t row0, int c0, int64_t k0, int64_t k1,
                            float* sums) {
  __m256 acc[R][NF];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_loadu_ps(sums + r * kBlock + 8 * (c0 + j));
  const int64_t k_count = p.in_features;
  const float* x0 = p.x + row0 * k_count;
  const int8_t* w = static_cast<const int8_t*>(p.packed) + (block * k_count + k0) * kBlock + 8 * c0;
  for (int64_t k = k0; k < k1; ++k, w += kBlock) {
    if (c0 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + kGemvChunkK * kBlock), _MM_HINT_T0);
    for (int j = 0; j < NF; ++j) {
      const __m256 wv = _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * j))));
      for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv, _mm256_broadcast_ss(x0 + r * k_count + k), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) _mm256_storeu_ps(sums + r * kBlock + 8 * (c0 + j), acc[r][j]);
}

// int4, packed[block][k / 2][64]: group g's q * x in registers, then sums += scale * that + offset
// * (the group's x sum), the dequantized weights' product.
template <int R, int NF>
CE_AVX2 void int4_cols_avx2(const Problem& p, int64_t block, int64_t row0, int c0, int64_t g, float* sums) {
  const int64_t k_count = p.in_features;
  const int64_t groups = k_count / p.group_size;
  const int64_t k_first = g * p.group_size;
  const float* x0 = p.x + row0 * k_count;
  const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (k_count / 2) + k_first / 2) * kBlock + 8 * c0;
  const int64_t ahead = p.group_size / 2 * kBlock;  // the next group, same columns
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  __m256 acc[R][NF];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NF; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = k_first; k < k_first + p.group_size; k += 2, w += kBlock) {
    if (c0 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + ahead), _MM_HINT_T0);
    for (int j = 0; j < NF; ++j) {
      const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * j));
      const __m256 even = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, low_mask)));
      const __m256 odd = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low_mask)));
      for (int r = 0; r < R; ++r) {
        acc[r][j] = _mm256_fmadd_ps(even, _mm256_broadcast_ss(x0 + r * k_count + k), acc[r][j]);
        acc[r][j] = _mm256_fmadd_ps(odd, _mm256_broadcast_ss(x0 + r * k_count + k + 1), acc[r][j]);
      }
    }
  }
  const float* scales = p.scales + (block * groups + g) * kBlock + 8 * c0;
  const float* offsets = p.offsets + (block * groups + g) * kBlock + 8 * c0;
  for (int j = 0; j < NF; ++j) {
    const __m256 scale = _mm256_loadu_ps(scales + 8 * j);
    const __m256 offset = _mm256_loadu_ps(offsets + 8 * j);
    for (int r = 0; r < R; ++r) {
      float* out = sums + r * kBlock + 8 * (c0 + j);
      const __m256 x_sum = _mm256_broadcast_ss(p.x_sums + (row0 + r) * groups + g);
      _mm256_storeu_ps(out, _mm256_fmadd_ps(acc[r][j], scale, _mm256_fmadd_ps(offset, x_sum, _mm256_loadu_ps(out))));
    }
  }
}

// The integer GEMV on AVX2 (bf16 / fp16 activations, even in_features; Problem::x16): as the VNNI
// paths without VNNI. The weights are widened to int16 and interleaved so that each 32-bit lane
// holds one output's pair of input features (k, k + 1); vpmaddwd multiplies that by x's pair and
// adds the two products in int32, vpaddd sums: 16 multiply-adds in two instructions, where the
// float path above spends a widening, a conversion and a multiply-add on 8. At one row the float
// path's instructions, not the bytes, bounded it (int4 ~15 GB/s on Zen 3, where torch.sum reads
// ~30). A pass covers NC groups of 16 outputs of R rows (R * NC * 2 int32 sums in registers), a
// block 4 / NC passes per chunk (int8: kX16Chunk input features, 16 KB; int4: one group); the
// float sums stay in L1 between chunks.
//
// vpunpcklwd / vpunpckhwd interleave within 128-bit lanes: of 16 outputs the two sums hold
// outputs {0-3, 8-11} and {4-7, 12-15}; ordered16 puts them back in order, as float32.
CE_AVX2 inline void ordered16(__m256i lo, __m256i hi, __m256& first, __m256& second) {
  const __m256 l = _mm256_cvtepi32_ps(lo), h = _mm256_cvtepi32_ps(hi);
  first = _mm256_permute2f128_ps(l, h, 0x20);
  second = _mm256_permute2f128_ps(l, h, 0x31);
}

// The 4 bytes at `at` in every 32-bit lane (a pair of int16 x, or four int8 ones).
CE_AVX2 inline __m256i broadcast_dword(const void* at) {
  int32_t dword;
  std::memcpy(&dword, at, sizeof dword);
  return _mm256_set1_epi32(dword);
}

CE_AVX2 inline __m256i x16_pair(const Problem& p, int64_t row, int64_t k) {
  return broadcast_dword(p.x16 + row * p.in_features + k);
}

// int8, packed[block][k][64]: inputs [k0, k1) (one x16 chunk), acc[r][16 * c0 ...] += scale * q.x.
template <int R, int NC>
CE_AVX2 void int8_cols_madd(const Problem& p, int64_t block, int64_t row0, int c0, int64_t k0, int64_t k1,
                            float* acc) {
  const int64_t k_count = p.in_features;
  const int8_t* w = static_cast<const int8_t*>(p.packed) + (block * k_count + k0) * kBlock + 16 * c0;
  __m256i sums[R][NC][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) sums[r][c][0] = sums[r][c][1] = _mm256_setzero_si256();
  for (int64_t k = k0; k < k1; k += 2, w += 2 * kBlock) {
    if (c0 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kX16PrefetchRows * kBlock), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kX16PrefetchRows + 1) * kBlock), _MM_HINT_T0);
    }
    for (int c = 0; c < NC; ++c) {
      const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
      const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kBlock + 16 * c)));
      const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = x16_pair(p, row0 + r, k);
        sums[r][c][0] = _mm256_add_epi32(sums[r][c][0], _mm256_madd_epi16(lo, xv));
        sums[r][c][1] = _mm256_add_epi32(sums[r][c][1], _mm256_madd_epi16(hi, xv));
      }
    }
  }
  const int64_t chunks = (k_count + kX16Chunk - 1) / kX16Chunk;
  for (int r = 0; r < R; ++r) {
    const __m256 scale = _mm256_set1_ps(p.x16_scales[(row0 + r) * chunks + k0 / kX16Chunk]);
    for (int c = 0; c < NC; ++c) {
      __m256 first, second;
      ordered16(sums[r][c][0], sums[r][c][1], first, second);
      float* out = acc + r * kBlock + 16 * (c0 + c);
      _mm256_store_ps(out, _mm256_fmadd_ps(first, scale, _mm256_load_ps(out)));
      _mm256_store_ps(out + 8, _mm256_fmadd_ps(second, scale, _mm256_load_ps(out + 8)));
    }
  }
}

// 8 outputs' scale and offset of a group (`at`: [block][group][64] index), from scale_zero where
// the weight has it (half the bytes), else the float32 arrays.
CE_AVX2 inline void group_scale_offset8(const Problem& p, int64_t at, __m256& scale, __m256& offset) {
  if (p.scale_zero != nullptr) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scale_zero + at));
    scale = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    const __m256 zero = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    offset = _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), scale, zero);  // zero - 8 scale, rounded once as the packer's
  } else {
    scale = _mm256_loadu_ps(p.scales + at);
    offset = _mm256_loadu_ps(p.offsets + at);
  }
}

// int4, packed[block][k / 2][64]: group g's q.x in int32 (a byte's low nibble is input k, its
// high one k + 1: and, shift, interleave), then acc += scale * x scale * that + offset * x sum.
template <int R, int NC>
CE_AVX2 void int4_cols_madd(const Problem& p, int64_t block, int64_t row0, int c0, int64_t g, float* acc) {
  const int64_t k_count = p.in_features;
  const int64_t groups = k_count / p.group_size;
  const int64_t k_first = g * p.group_size;
  const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (k_count / 2) + k_first / 2) * kBlock + 16 * c0;
  const __m256i low_nibble = _mm256_set1_epi16(0x0F);
  __m256i sums[R][NC][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) sums[r][c][0] = sums[r][c][1] = _mm256_setzero_si256();
  for (int64_t k = k_first; k < k_first + p.group_size; k += 2, w += kBlock) {
    if (c0 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + kX16PrefetchRows * kBlock), _MM_HINT_T0);
    for (int c = 0; c < NC; ++c) {
      const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
      const __m256i even = _mm256_and_si256(v, low_nibble), odd = _mm256_srli_epi16(v, 4);
      const __m256i lo = _mm256_unpacklo_epi16(even, odd), hi = _mm256_unpackhi_epi16(even, odd);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = x16_pair(p, row0 + r, k);
        sums[r][c][0] = _mm256_add_epi32(sums[r][c][0], _mm256_madd_epi16(lo, xv));
        sums[r][c][1] = _mm256_add_epi32(sums[r][c][1], _mm256_madd_epi16(hi, xv));
      }
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int64_t at = (block * groups + g) * kBlock + 16 * (c0 + c);
    __m256 scale0, offset0, scale1, offset1;
    group_scale_offset8(p, at, scale0, offset0);
    group_scale_offset8(p, at + 8, scale1, offset1);
    for (int r = 0; r < R; ++r) {
      const __m256 xs = _mm256_set1_ps(p.x16_scales[(row0 + r) * groups + g]);
      const __m256 x_sum = _mm256_set1_ps(p.x_sums[(row0 + r) * groups + g]);
      __m256 first, second;
      ordered16(sums[r][c][0], sums[r][c][1], first, second);
      float* out = acc + r * kBlock + 16 * (c0 + c);
      _mm256_store_ps(out, _mm256_fmadd_ps(first, _mm256_mul_ps(scale0, xs),
                                           _mm256_fmadd_ps(offset0, x_sum, _mm256_load_ps(out))));
      _mm256_store_ps(out + 8, _mm256_fmadd_ps(second, _mm256_mul_ps(scale1, xs),
                                               _mm256_fmadd_ps(offset1, x_sum, _mm256_load_ps(out + 8))));
    }
  }
}

// One block of R rows on AVX2: int4 a group at a time, int8 a chunk of inputs at a time, each in
// passes over the block's columns (NF of them a pass): the float loops' columns are registers of 8
// outputs, in chunks of kGemvChunkK inputs; the integer loops' (kInteger) groups of 16, in x16
// chunks.
template <int R, int NF, bool kInt4, bool kInteger>
void block_avx2(const Problem& p, int64_t block, int64_t row0) {
  constexpr int kColumns = kInteger ? 4 : 8;
  constexpr int64_t kChunk = kInteger ? kX16Chunk : kGemvChunkK;
  alignas(32) float sums[R * kBlock] = {};
  if constexpr (kInt4) {
    for (int64_t g = 0; g < p.in_features / p.group_size; ++g)
      for (int c0 = 0; c0 < kColumns; c0 += NF) {
        if constexpr (kInteger) int4_cols_madd<R, NF>(p, block, row0, c0, g, sums);
        else int4_cols_avx2<R, NF>(p, block, row0, c0, g, sums);
      }
  } else {
    for (int64_t k0 = 0; k0 < p.in_features; k0 += kChunk) {
      const int64_t k1 = std::min(k0 + kChunk, p.in_features);
      for (int c0 = 0; c0 < kColumns; c0 += NF) {
        if constexpr (kInteger) int8_cols_madd<R, NF>(p, block, row0, c0, k0, k1, sums);
        else int8_cols_avx2<R, NF>(p, block, row0, c0, k0, k1, sums);
      }
    }
  }
  finish_block(p, block, row0, R, sums, !kInt4);
}

// Many rows (ce_cpu_gemm_* on AVX2, where there are no tiles): past a few rows the GEMV's cost is
// widening the integers again for every 4 rows, not reading them. This path dequantizes kChunkK
// input features of a 64-output block to float32 once (16 KB, in L1: int8 as q, its scale applied
// at the end; int4 as q * scale + offset) and multiplies up to kSlabRows rows by them, 6 rows x 16
// outputs in registers at a time, with the rows' sums [rows][64] kept in L1 between chunks. The
// integers are read and widened once per kSlabRows rows, and the rest is multiply-adds.
constexpr int64_t kChunkK = 64;
constexpr int64_t kSlabRows = 64;
// Rows a register tile: 6 rows x 16 outputs of sums, 2 of weights and a broadcast are 15 of the
// 16 ymm, one broadcast per two multiply-adds (as kernels/cpu_gemv.cpp's register tiles).
constexpr int64_t kChunkRows = 6;
// Fewer rows take the GEMV's loops, which read each weight once per 4 rows with no widened copy:
// a prefill bucket's LM head runs only its sampled rows (one, at one request), where widening the
// whole head for them cost several times the GEMV's read.
constexpr int64_t kDequantizeOnceRows = 8;

template <bool kInt4>
CE_AVX2 void dequantize_chunk_avx2(const Problem& p, int64_t block, int64_t k0, int64_t kc, float* chunk) {
  const int64_t k_count = p.in_features;
  if constexpr (kInt4) {  // k0 and kc even (kChunkK and in_features are), a pair in one group
    const int64_t groups = k_count / p.group_size;
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    for (int64_t k = k0; k < k0 + kc; k += 2) {
      const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (k_count / 2) + k / 2) * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(w + kChunkK / 2 * kBlock), _MM_HINT_T0);
      const int64_t at = (block * groups + k / p.group_size) * kBlock;
      float* even = chunk + (k - k0) * kBlock;
      for (int j = 0; j < 8; ++j) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * j));
        const __m256 scale = _mm256_loadu_ps(p.scales + at + 8 * j);
        const __m256 offset = _mm256_loadu_ps(p.offsets + at + 8 * j);
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, low_mask)));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low_mask)));
        _mm256_store_ps(even + 8 * j, _mm256_fmadd_ps(lo, scale, offset));
        _mm256_store_ps(even + kBlock + 8 * j, _mm256_fmadd_ps(hi, scale, offset));
      }
    }
  } else {
    for (int64_t k = k0; k < k0 + kc; ++k) {
      const int8_t* w = static_cast<const int8_t*>(p.packed) + (block * k_count + k) * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(w + kChunkK * kBlock), _MM_HINT_T0);
      for (int j = 0; j < 8; ++j)
        _mm256_store_ps(chunk + (k - k0) * kBlock + 8 * j,
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 8 * j)))));
    }
  }
}

// sums[r][64] += x[r][0..kc) . chunk[0..kc)[64] for R rows (x row stride x_stride).
template <int R>
CE_AVX2 void rows_times_chunk_avx2(const float* chunk, int64_t kc, const float* x, int64_t x_stride, float* sums) {
  for (int c0 = 0; c0 < 8; c0 += 2) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm256_loadu_ps(sums + r * kBlock + 8 * (c0 + j));
    const float* w = chunk + 8 * c0;
    for (int64_t kk = 0; kk < kc; ++kk, w += kBlock) {
      const __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * x_stride + kk);
        acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 2; ++j) _mm256_storeu_ps(sums + r * kBlock + 8 * (c0 + j), acc[r][j]);
  }
}

// One block, all rows; `sums` holds kSlabRows * 64 floats.
template <bool kInt4>
void many_rows_block_avx2(const Problem& p, int64_t block, float* sums) {
  alignas(32) float chunk[kChunkK * kBlock];
  const int64_t k_count = p.in_features;
  for (int64_t slab = 0; slab < p.rows; slab += kSlabRows) {
    const int64_t rows = std::min(kSlabRows, p.rows - slab);
    std::fill(sums, sums + rows * kBlock, 0.0f);
    for (int64_t k0 = 0; k0 < k_count; k0 += kChunkK) {
      const int64_t kc = std::min(kChunkK, k_count - k0);
      dequantize_chunk_avx2<kInt4>(p, block, k0, kc, chunk);
      for (int64_t r = 0; r < rows; r += kChunkRows) {
        const float* x = p.x + (slab + r) * k_count + k0;
        float* s = sums + r * kBlock;
        switch (std::min<int64_t>(kChunkRows, rows - r)) {
          case 1: rows_times_chunk_avx2<1>(chunk, kc, x, k_count, s); break;
          case 2: rows_times_chunk_avx2<2>(chunk, kc, x, k_count, s); break;
          case 3: rows_times_chunk_avx2<3>(chunk, kc, x, k_count, s); break;
          case 4: rows_times_chunk_avx2<4>(chunk, kc, x, k_count, s); break;
          case 5: rows_times_chunk_avx2<5>(chunk, kc, x, k_count, s); break;
          default: rows_times_chunk_avx2<6>(chunk, kc, x, k_count, s); break;
        }
      }
    }
    finish_block(p, block, slab, static_cast<int>(rows), sums, !kInt4);
  }
}

// The same for bf16 / fp16 x in int16 (Problem::x16, the integer GEMV's rounding): each chunk of
// at most kChunkK input features of a block (within one x16 chunk: 256 inputs for int8, one group
// for int4) widened once to int16 pairs (k, k + 1) per output (8 KB, in L1, vpunpck order as the
// GEMV's), then kChunkRows rows x 16 outputs of int32 sums in registers, vpmaddwd + vpaddd: 16
// multiply-adds in two instructions against the float tiles' 8 in one (bench/test_widened_linear.py
// -k decode_rows has it against the float path this replaced for bf16 x). The sums are
// folded into the float ones after each chunk (int8: times the row's x16 scale, the weight scale
// in finish_block; int4: times scale x the row's x16 scale, and offset x the group's x sum once
// a group).
constexpr int64_t kPairsPerChunk = kChunkK / 2;

// int4, group g of a block for the rows [slab, slab + rows): the group's 64 scales into `scale`,
// and sums[r][64] += offset x the group's x sum (its dequantized weights' constant part).
CE_AVX2 void group_offsets_avx2(const Problem& p, int64_t block, int64_t g, int64_t slab, int64_t rows, float* scale,
                                float* sums) {
  const int64_t groups = p.in_features / p.group_size;
  __m256 offset[8];
  for (int j = 0; j < 8; ++j) {
    __m256 sc;
    group_scale_offset8(p, (block * groups + g) * kBlock + 8 * j, sc, offset[j]);
    _mm256_store_ps(scale + 8 * j, sc);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 x_sum = _mm256_set1_ps(p.x_sums[(slab + r) * groups + g]);
    for (int j = 0; j < 8; ++j) {
      float* out = sums + r * kBlock + 8 * j;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(offset[j], x_sum, _mm256_loadu_ps(out)));
    }
  }
}

template <bool kInt4>
CE_AVX2 void widen_pairs_avx2(const Problem& p, int64_t block, int64_t k0, int64_t kc, __m256i* pairs) {
  const int64_t k_count = p.in_features;
  const __m256i low_nibble = _mm256_set1_epi16(0x0F);
  for (int64_t k = k0; k < k0 + kc; k += 2, pairs += 8) {
    if constexpr (kInt4) {
      const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (k_count / 2) + k / 2) * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(w + kPairsPerChunk * kBlock), _MM_HINT_T0);
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
        const __m256i even = _mm256_and_si256(v, low_nibble), odd = _mm256_srli_epi16(v, 4);
        _mm256_store_si256(pairs + 2 * c, _mm256_unpacklo_epi16(even, odd));
        _mm256_store_si256(pairs + 2 * c + 1, _mm256_unpackhi_epi16(even, odd));
      }
    } else {
      const int8_t* w = static_cast<const int8_t*>(p.packed) + (block * k_count + k) * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(w + kChunkK * kBlock), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (kChunkK + 1) * kBlock), _MM_HINT_T0);
      for (int c = 0; c < 4; ++c) {
        const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kBlock + 16 * c)));
        _mm256_store_si256(pairs + 2 * c, _mm256_unpacklo_epi16(a, b));
        _mm256_store_si256(pairs + 2 * c + 1, _mm256_unpackhi_epi16(a, b));
      }
    }
  }
}

// sums[r][64] += factor[r] * scale[64] * (x16[r][k0, k0 + 2 npairs) . pairs) for R rows (x16 row
// stride in_features; `scale` null: 1).
template <int R>
CE_AVX2 void rows_times_pairs_avx2(const __m256i* pairs, int64_t npairs, const int16_t* x16, int64_t x_stride,
                                   const float* factor, const float* scale, float* sums) {
  for (int c = 0; c < 4; ++c) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int64_t i = 0; i < npairs; ++i) {
      const __m256i lo = _mm256_load_si256(pairs + 8 * i + 2 * c), hi = _mm256_load_si256(pairs + 8 * i + 2 * c + 1);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = broadcast_dword(x16 + r * x_stride + 2 * i);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(lo, xv));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(hi, xv));
      }
    }
    const __m256 scale0 = scale ? _mm256_load_ps(scale + 16 * c) : _mm256_set1_ps(1.0f);
    const __m256 scale1 = scale ? _mm256_load_ps(scale + 16 * c + 8) : _mm256_set1_ps(1.0f);
    for (int r = 0; r < R; ++r) {
      __m256 first, second;
      ordered16(acc[r][0], acc[r][1], first, second);
      const __m256 f = _mm256_set1_ps(factor[r]);
      float* out = sums + r * kBlock + 16 * c;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(first, _mm256_mul_ps(scale0, f), _mm256_loadu_ps(out)));
      _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(second, _mm256_mul_ps(scale1, f), _mm256_loadu_ps(out + 8)));
    }
  }
}

// One block, all rows; `sums` holds kSlabRows * 64 floats.
template <bool kInt4>
void many_rows_block_madd(const Problem& p, int64_t block, float* sums) {
  alignas(32) __m256i pairs[kPairsPerChunk * 8];
  alignas(32) float scale[kBlock];
  const int64_t k_count = p.in_features;
  const int64_t span = kInt4 ? p.group_size : kX16Chunk;  // the inputs one x16 scale covers
  const int64_t spans = (k_count + span - 1) / span;
  for (int64_t slab = 0; slab < p.rows; slab += kSlabRows) {
    const int64_t rows = std::min(kSlabRows, p.rows - slab);
    std::fill(sums, sums + rows * kBlock, 0.0f);
    for (int64_t s = 0; s < spans; ++s) {
      const int64_t span_end = std::min(k_count, (s + 1) * span);
      if constexpr (kInt4) group_offsets_avx2(p, block, s, slab, rows, scale, sums);
      float factor[kSlabRows];
      for (int64_t r = 0; r < rows; ++r) factor[r] = p.x16_scales[(slab + r) * spans + s];
      for (int64_t k0 = s * span; k0 < span_end; k0 += kChunkK) {
        const int64_t kc = std::min(kChunkK, span_end - k0);
        widen_pairs_avx2<kInt4>(p, block, k0, kc, pairs);
        for (int64_t r = 0; r < rows; r += kChunkRows) {
          const int16_t* x16 = p.x16 + (slab + r) * k_count + k0;
          const float* f = factor + r;
          const float* sc = kInt4 ? scale : nullptr;
          float* out = sums + r * kBlock;
          switch (std::min<int64_t>(kChunkRows, rows - r)) {
            case 1: rows_times_pairs_avx2<1>(pairs, kc / 2, x16, k_count, f, sc, out); break;
            case 2: rows_times_pairs_avx2<2>(pairs, kc / 2, x16, k_count, f, sc, out); break;
            case 3: rows_times_pairs_avx2<3>(pairs, kc / 2, x16, k_count, f, sc, out); break;
            case 4: rows_times_pairs_avx2<4>(pairs, kc / 2, x16, k_count, f, sc, out); break;
            case 5: rows_times_pairs_avx2<5>(pairs, kc / 2, x16, k_count, f, sc, out); break;
            default: rows_times_pairs_avx2<6>(pairs, kc / 2, x16, k_count, f, sc, out); break;
          }
        }
      }
    }
    finish_block(p, block, slab, static_cast<int>(rows), sums, !kInt4);
  }
}

// int4 many rows for bf16 / fp16 x with 8-bit x (Problem::x8; group sizes a multiple of 32): the
// prompt's linears, where the int16 tiles above are bound by their multiply-adds, not bytes. x is
// rounded to int8 per 32 inputs of a row (s = max|x| / 127, as llama.cpp's Q8_0 activations that
// its Q4_0 prompt multiplies), and vpmaddubsw multiplies the unsigned nibbles by it four inputs an
// output a lane: 32 multiply-adds an instruction, summed in int16 over the 32 inputs (8 steps x 2
// x 15 x 127 < 2^15), then widened once (vpmaddwd by ones) and folded into the float sums with the
// group's scale x the row's x scale; the offset x the group's x sum as above. Per 32 inputs and 16
// outputs of a row that is 16 multiply-adds and 16 adds where the int16 tiles take 32 of each. The
// rounding costs ~1 % of a linear's largest output (bf16 rounds to ~0.4 %); tests hold it to a
// reference that rounds x the same way.
constexpr int64_t kQuadSteps = 8;                 // steps of 4 inputs summed in int16
constexpr int64_t kQuadChunkK = 4 * kQuadSteps;   // 32 inputs: the unit a group must be a multiple of
constexpr int kQuadRows = 6;

// The 32 inputs [k0, k0 + 32) of a block as 8 steps x 64 outputs x 4 unsigned bytes (one output's
// inputs k .. k + 3 a 32-bit lane, outputs in order), from packed rows k0 / 2 .. k0 / 2 + 15.
CE_AVX2 void widen_quads_avx2(const Problem& p, int64_t block, int64_t k0, __m256i* quads) {
  const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (p.in_features / 2) + k0 / 2) * kBlock;
  const __m128i low_nibble = _mm_set1_epi8(0x0F);
  for (int64_t t = 0; t < kQuadSteps; ++t) {
    const uint8_t* r0 = w + 2 * t * kBlock;  // inputs k, k + 1 of 64 outputs; r0 + kBlock: k + 2, k + 3
    _mm_prefetch(reinterpret_cast<const char*>(r0 + (kQuadChunkK / 2) * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(r0 + (kQuadChunkK / 2 + 1) * kBlock), _MM_HINT_T0);
    char* out = reinterpret_cast<char*>(quads + 8 * t);
    for (int c = 0; c < 4; ++c) {  // 16 outputs
      const __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 16 * c));
      const __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + kBlock + 16 * c));
      const __m128i k_0 = _mm_and_si128(b0, low_nibble), k_1 = _mm_and_si128(_mm_srli_epi16(b0, 4), low_nibble);
      const __m128i k_2 = _mm_and_si128(b1, low_nibble), k_3 = _mm_and_si128(_mm_srli_epi16(b1, 4), low_nibble);
      const __m128i first_lo = _mm_unpacklo_epi8(k_0, k_1), first_hi = _mm_unpackhi_epi8(k_0, k_1);
      const __m128i second_lo = _mm_unpacklo_epi8(k_2, k_3), second_hi = _mm_unpackhi_epi8(k_2, k_3);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 * c), _mm_unpacklo_epi16(first_lo, second_lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 * c + 16), _mm_unpackhi_epi16(first_lo, second_lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 * c + 32), _mm_unpacklo_epi16(first_hi, second_hi));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 * c + 48), _mm_unpackhi_epi16(first_hi, second_hi));
    }
  }
}

// sums[r][64] += factor[r] * scale[64] * (x8[r][0, 32) . quads) for R rows (x8 row stride
// x_stride).
template <int R>
CE_AVX2 void rows_times_quads_avx2(const __m256i* quads, const int8_t* x8, int64_t x_stride, const float* factor,
                                   const float* scale, float* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int c = 0; c < 4; ++c) {
    __m256i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    // Not unrolled: unrolled, GCC regrouped the adds into trees and kept the products on the stack.
#pragma GCC unroll 1
    for (int64_t t = 0; t < kQuadSteps; ++t) {
      const __m256i w0 = _mm256_load_si256(quads + 8 * t + 2 * c), w1 = _mm256_load_si256(quads + 8 * t + 2 * c + 1);
      if constexpr (R == 6) {
        // The full tile's step in asm: with intrinsics GCC hoisted the six broadcasts and kept
        // sums on the stack (12 sums, 2 weights, a broadcast (ymm14) and a product (ymm15) are the
        // 16 ymm).
        const int8_t* b0 = x8 + 4 * t;
        const int8_t* b3 = b0 + 3 * x_stride;
        asm("vpbroadcastd (%[b0]), %%ymm14\n\t"
            "vpmaddubsw %%ymm14, %[w0], %%ymm15\n\tvpaddw %%ymm15, %[a00], %[a00]\n\t"
            "vpmaddubsw %%ymm14, %[w1], %%ymm15\n\tvpaddw %%ymm15, %[a01], %[a01]\n\t"
            "vpbroadcastd (%[b0],%[s]), %%ymm14\n\t"
            "vpmaddubsw %%ymm14, %[w0], %%ymm15\n\tvpaddw %%ymm15, %[a10], %[a10]\n\t"
            "vpmaddubsw %%ymm14, %[w1], %%ymm15\n\tvpaddw %%ymm15, %[a11], %[a11]\n\t"
            "vpbroadcastd (%[b0],%[s],2), %%ymm14\n\t"
            "vpmaddubsw %%ymm14, %[w0], %%ymm15\n\tvpaddw %%ymm15, %[a20], %[a20]\n\t"
            "vpmaddubsw %%ymm14, %[w1], %%ymm15\n\tvpaddw %%ymm15, %[a21], %[a21]\n\t"
            "vpbroadcastd (%[b3]), %%ymm14\n\t"
            "vpmaddubsw %%ymm14, %[w0], %%ymm15\n\tvpaddw %%ymm15, %[a30], %[a30]\n\t"
            "vpmaddubsw %%ymm14, %[w1], %%ymm15\n\tvpaddw %%ymm15, %[a31], %[a31]\n\t"
            "vpbroadcastd (%[b3],%[s]), %%ymm14\n\t"
            "vpmaddubsw %%ymm14, %[w0], %%ymm15\n\tvpaddw %%ymm15, %[a40], %[a40]\n\t"
            "vpmaddubsw %%ymm14, %[w1], %%ymm15\n\tvpaddw %%ymm15, %[a41], %[a41]\n\t"
            "vpbroadcastd (%[b3],%[s],2), %%ymm14\n\t"
            "vpmaddubsw %%ymm14, %[w0], %%ymm15\n\tvpaddw %%ymm15, %[a50], %[a50]\n\t"
            "vpmaddubsw %%ymm14, %[w1], %%ymm15\n\tvpaddw %%ymm15, %[a51], %[a51]"
            : [a00] "+x"(acc[0][0]), [a01] "+x"(acc[0][1]), [a10] "+x"(acc[1][0]), [a11] "+x"(acc[1][1]),
              [a20] "+x"(acc[2][0]), [a21] "+x"(acc[2][1]), [a30] "+x"(acc[3][0]), [a31] "+x"(acc[3][1]),
              [a40] "+x"(acc[4][0]), [a41] "+x"(acc[4][1]), [a50] "+x"(acc[5][0]), [a51] "+x"(acc[5][1])
            : [w0] "x"(w0), [w1] "x"(w1), [b0] "r"(b0), [b3] "r"(b3), [s] "r"(x_stride)
            : "ymm14", "ymm15", "memory");
        continue;
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xv = broadcast_dword(x8 + r * x_stride + 4 * t);
        acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(w0, xv));
        acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(w1, xv));
      }
    }
    const __m256 scale0 = _mm256_load_ps(scale + 16 * c), scale1 = _mm256_load_ps(scale + 16 * c + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 f = _mm256_set1_ps(factor[r]);
      float* out = sums + r * kBlock + 16 * c;
      const __m256 first = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][0], ones));
      const __m256 second = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][1], ones));
      _mm256_storeu_ps(out, _mm256_fmadd_ps(first, _mm256_mul_ps(scale0, f), _mm256_loadu_ps(out)));
      _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(second, _mm256_mul_ps(scale1, f), _mm256_loadu_ps(out + 8)));
    }
  }
}

// One block, all rows, int4 with Problem::x8; `sums` holds kSlabRows * 64 floats.
void many_rows_block_quads(const Problem& p, int64_t block, float* sums) {
  alignas(32) __m256i quads[kQuadSteps * 8];
  alignas(32) float scale[kBlock];
  const int64_t k_count = p.in_features;
  const int64_t groups = k_count / p.group_size, chunks = k_count / kQuadChunkK;
  for (int64_t slab = 0; slab < p.rows; slab += kSlabRows) {
    const int64_t rows = std::min(kSlabRows, p.rows - slab);
    std::fill(sums, sums + rows * kBlock, 0.0f);
    for (int64_t g = 0; g < groups; ++g) {
      group_offsets_avx2(p, block, g, slab, rows, scale, sums);
      for (int64_t k0 = g * p.group_size; k0 < (g + 1) * p.group_size; k0 += kQuadChunkK) {
        float factor[kSlabRows];  // the rows' x scales for these 32 inputs
        for (int64_t r = 0; r < rows; ++r) factor[r] = p.x8_scales[(slab + r) * chunks + k0 / kQuadChunkK];
        widen_quads_avx2(p, block, k0, quads);
        for (int64_t r = 0; r < rows; r += kQuadRows) {
          const int8_t* x8 = p.x8 + (slab + r) * k_count + k0;
          const float* f = factor + r;
          float* out = sums + r * kBlock;
          switch (std::min<int64_t>(kQuadRows, rows - r)) {
            case 1: rows_times_quads_avx2<1>(quads, x8, k_count, f, scale, out); break;
            case 2: rows_times_quads_avx2<2>(quads, x8, k_count, f, scale, out); break;
            case 3: rows_times_quads_avx2<3>(quads, x8, k_count, f, scale, out); break;
            case 4: rows_times_quads_avx2<4>(quads, x8, k_count, f, scale, out); break;
            case 5: rows_times_quads_avx2<5>(quads, x8, k_count, f, scale, out); break;
            default: rows_times_quads_avx2<kQuadRows>(quads, x8, k_count, f, scale, out); break;
          }
        }
      }
    }
    finish_block(p, block, slab, static_cast<int>(rows), sums, false);
  }
}

// ---- many rows on AVX-512 without AMX (BF16 dot products) -------------------------------------
//
// Past a few rows the GEMV's cost is widening the integers again for every 4 rows, and on a CPU
// without AMX the tile path is not there. This path widens one chunk of a 64-output block once, to
// bf16 pairs of input features (k, k + 1) side by side in each 32-bit lane (the layout vdpbf16ps
// reads), into a buffer that stays in L1, and runs every row of the call through it: kManyR rows x
// 64 outputs in registers, x broadcast two bf16 features at a time as it came (no copy, no
// rounding), float32 sums; the rows' sums [256][64] stay in L2 between chunks.
//
//   int8: kManyChunk8 input features at a time, as the integers q themselves (exact in bf16:
//         float(q) has its low 16 bits zero, so its high half is bf16(q)); the weight scale is
//         applied once, at the end.
//   int4: one quantization group at a time, each byte's two nibbles spread into the two halves of
//         a 32-bit lane and or-ed with 0x4300: bf16 (128 + q), exact; then per row the group's
//         scale and offset: sum (128 + q) x * scale + (offset - 128 scale) * (the group's x sum)
//         = sum (q scale + offset) x. From kManyDequantRows rows the group is instead dequantized
//         to bf16 q * scale + offset once (rounded, as the AMX tiles do), so the rows need no
//         per-group multiply-adds: those cost more than the dearer widening there.
//
// bf16 activations only. The integers are read and widened once per kManySlab rows; the rest is
// dot-product instructions (two a cycle on Zen 4, 64 multiply-adds).
#if defined(__AVX512BF16__)
#define CE_MANY_AVX512_AVAILABLE 1
#define CE_MANY __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))

constexpr int64_t kManySlab = 256;   // rows per widening of a chunk; their float32 sums, 64 KB, in L2
                                     // (64 rows, sums in L1, measured 4-6 % slower at 512-2,048 rows)
constexpr int64_t kManyPanel = 256;  // rows run over every block before the next ones (x in L2)
constexpr int64_t kManyChunk8 = 128; // int8: input features widened at a time (16 KB of bf16 pairs)
constexpr int kManyR = 4;            // rows per pass over a chunk: 16 accumulators (GCC spills at 6)
constexpr int64_t kManyDequantRows = 24;  // int4 from this many rows: weights dequantized to bf16 once
constexpr int64_t kManyMaxPairs = 128;  // the chunk buffer's pairs of input features: int8's 64, int4's
                                        // group / 2 (groups up to 256; 32 KB)

struct ManyRows {
  const Problem* p;
  const uint16_t* x;    // bf16 rows, row stride x_stride
  int64_t x_stride;
  const float* x_sums;  // int4: [rows][groups]
  int64_t chunks;       // int8: input chunks of kManyChunk8; int4: groups
};

CE_MANY inline __m512 bf16x16_to_float(const uint16_t* x, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, x)), 16));
}

CE_MANY inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// int4's offsets' multiplier: the sum of each group's x, per row.
CE_MANY void prepare_x_sums(const uint16_t* x, int64_t x_stride, int64_t rows, int64_t k_count, int64_t group_size,
                            float* x_sums) {
  const int64_t groups = k_count / group_size;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 s = _mm512_setzero_ps();
      for (int64_t k = g * group_size; k < (g + 1) * group_size; k += 16)
        s = _mm512_add_ps(s, bf16x16_to_float(x + r * x_stride + k, tail_mask((g + 1) * group_size - k)));
      x_sums[r * groups + g] = _mm512_reduce_add_ps(s);
    }
}

// int8 input features [k0, k1) of a block -> bf16 pairs, 4 vectors per pair of features (k1 - k0
// odd only at the last feature: its partner is 0).
CE_MANY void widen_int8_chunk(const int8_t* w, int64_t k0, int64_t k1, __m512i* pairs) {
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t k = k0; k < k1; k += 2, pairs += 4) {
    const int8_t* a = w + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(a + kManyChunk8 * kBlock), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(a + (kManyChunk8 + 1) * kBlock), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) {
      const __m512i lo = _mm512_castps_si512(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * c)))));
      __m512i hi = _mm512_setzero_si512();
      if (k + 1 < k1)
        hi = _mm512_castps_si512(_mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + kBlock + 16 * c)))));
      // (lo >> 16) | (hi & 0xFFFF0000): bf16(q_k) in the low half, bf16(q_k+1) in the high one.
      _mm512_store_si512(pairs + c, _mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 16), hi, high, 0xF8));
    }
  }
}

// int4 group g of a block -> bf16 (128 + q) pairs, 4 vectors per pair of features.
CE_MANY void widen_int4_group(const uint8_t* w, int64_t pair_rows, __m512i* pairs) {
  const __m512i nibbles = _mm512_set1_epi32(0x000F000F), bias = _mm512_set1_epi32(0x43004300);
  for (int64_t kk = 0; kk < pair_rows; ++kk, w += kBlock, pairs += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 32 * kBlock), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
      // (b | b << 12) & 0x000F000F, then | 0x43004300: bf16 128 + low nibble, 128 + high nibble.
      const __m512i q = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), nibbles, 0xA8);
      _mm512_store_si512(pairs + c, _mm512_or_si512(q, bias));
    }
  }
}

// int4 group g of a block -> bf16 pairs of the dequantized weights q * scale + offset, rounded to
// bf16 (the rounding a bf16 weight carries): dearer to widen than (128 + q), but the rows then need
// no per-group scale and offset, which is what costs at many rows (kManyDequantRows).
CE_MANY void dequantize_int4_group(const uint8_t* w, int64_t pair_rows, const __m512* scale, const __m512* offset,
                                   __m512i* pairs) {
  alignas(64) static const uint16_t kOrder[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8,  24, 9,  25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kOrder);
  const __m512i low = _mm512_set1_epi32(0x0F);
  for (int64_t kk = 0; kk < pair_rows; ++kk, w += kBlock, pairs += 4) {
    _mm_prefetch(reinterpret_cast<const char*>(w + 32 * kBlock), _MM_HINT_T0);
    for (int c = 0; c < 4; ++c) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
      const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, low)), scale[c], offset[c]);
      const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), scale[c], offset[c]);
      _mm512_store_si512(pairs + c, _mm512_permutexvar_epi16(order, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo))));
    }
  }
}

// s[r][0..4) += x[r] pairs . the chunk's pairs, R rows (x[r]: the row's first feature of the chunk).
template <int R>
CE_MANY inline void rows_dot_pairs(const __m512i* pairs, int64_t num_pairs, const uint16_t* const* x, __m512 (&s)[R][4]) {
  for (int64_t i = 0; i < num_pairs; ++i, pairs += 4) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_load_si512(pairs));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_load_si512(pairs + 1));
    const __m512bh w2 = reinterpret_cast<__m512bh>(_mm512_load_si512(pairs + 2));
    const __m512bh w3 = reinterpret_cast<__m512bh>(_mm512_load_si512(pairs + 3));
    for (int r = 0; r < R; ++r) {
      int32_t xk;
      std::memcpy(&xk, x[r] + 2 * i, sizeof xk);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xk));
      s[r][0] = _mm512_dpbf16_ps(s[r][0], w0, xv);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], w1, xv);
      s[r][2] = _mm512_dpbf16_ps(s[r][2], w2, xv);
      s[r][3] = _mm512_dpbf16_ps(s[r][3], w3, xv);
    }
  }
}

// acc[r][64] += the rows' products with the chunk (int8, or int4 dequantized), R rows from slab row `row`.
template <int R>
CE_MANY void rows_chunk(const ManyRows& m, const __m512i* pairs, int64_t num_pairs, int64_t row, int64_t k0,
                             float* acc) {
  const uint16_t* x[R];
  __m512 s[R][4];
  for (int r = 0; r < R; ++r) {
    x[r] = m.x + (row + r) * m.x_stride + k0;
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_load_ps(acc + r * kBlock + 16 * c);
  }
  rows_dot_pairs<R>(pairs, num_pairs, x, s);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + r * kBlock + 16 * c, s[r][c]);
}

// acc[r][64] += the group's sums, scale and offset applied (int4), R rows from slab row `row`.
template <int R>
CE_MANY void int4_rows_group(const ManyRows& m, const __m512i* pairs, int64_t num_pairs, int64_t row, int64_t g,
                             const __m512* scale, const __m512* offset, float* acc) {
  const uint16_t* x[R];
  __m512 s[R][4];
  for (int r = 0; r < R; ++r) {
    x[r] = m.x + (row + r) * m.x_stride + g * m.p->group_size;
    for (int c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  }
  rows_dot_pairs<R>(pairs, num_pairs, x, s);
  for (int r = 0; r < R; ++r) {
    const __m512 x_sum = _mm512_set1_ps(m.x_sums[(row + r) * m.chunks + g]);
    float* a = acc + r * kBlock;
    for (int c = 0; c < 4; ++c)
      _mm512_store_ps(a + 16 * c,
                      _mm512_fmadd_ps(offset[c], x_sum, _mm512_fmadd_ps(s[r][c], scale[c], _mm512_load_ps(a + 16 * c))));
  }
}

// The slab's sums -> bf16 outputs: int8's scale applied, the bias added.
CE_MANY void finish_many(const Problem& p, int64_t block, int64_t row0, int64_t nrows, const float* acc, bool int8) {
  const int64_t first = block * kBlock;
  const int64_t count = std::min(kBlock, p.out_features - first);
  for (int64_t r = 0; r < nrows; ++r) {
    uint16_t* out = static_cast<uint16_t*>(p.out) + (row0 + r) * p.out_features + first;
    for (int64_t f = 0; f < count; f += 16) {
      const __mmask16 mask = tail_mask(count - f);
      __m512 y = _mm512_load_ps(acc + r * kBlock + f);
      if (int8) y = _mm512_mul_ps(y, _mm512_loadu_ps(p.scales + first + f));
      if (p.bias != nullptr)
        y = _mm512_add_ps(y, bf16x16_to_float(static_cast<const uint16_t*>(p.bias) + first + f, mask));
      _mm256_mask_storeu_epi16(out + f, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
    }
  }
}

template <bool kInt4>
CE_MANY void many_rows_block_avx512(const ManyRows& m, int64_t block, int64_t row_begin, int64_t row_end,
                                    __m512i* pairs, float* acc) {
  const Problem& p = *m.p;
  const int64_t k_count = p.in_features;
  for (int64_t slab = row_begin; slab < row_end; slab += kManySlab) {
    const int64_t rows = std::min(kManySlab, row_end - slab);
    std::fill(acc, acc + rows * kBlock, 0.0f);
    for (int64_t chunk = 0; chunk < m.chunks; ++chunk) {
      __m512 scale[4], offset[4];
      int64_t num_pairs, k0;
      const bool dequantized = kInt4 && row_end - row_begin >= kManyDequantRows;
      if constexpr (kInt4) {
        const int64_t half = p.group_size / 2;
        const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (k_count / 2) + chunk * half) * kBlock;
        const int64_t at = (block * m.chunks + chunk) * kBlock;
        for (int c = 0; c < 4; ++c) group_scale_offset(p, at + 16 * c, scale[c], offset[c]);
        if (dequantized) {
          dequantize_int4_group(w, half, scale, offset, pairs);
        } else {
          widen_int4_group(w, half, pairs);
          for (int c = 0; c < 4; ++c) offset[c] = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), scale[c], offset[c]);
        }
        num_pairs = half;
        k0 = chunk * p.group_size;
      } else {
        k0 = chunk * kManyChunk8;
        const int64_t k1 = std::min(k_count, k0 + kManyChunk8);
        widen_int8_chunk(static_cast<const int8_t*>(p.packed) + block * k_count * kBlock, k0, k1, pairs);
        num_pairs = (k1 - k0) / 2;  // an odd last feature: the tail below
      }
      for (int64_t r = 0; r < rows; r += kManyR) {
        const int64_t row = slab + r;
        float* a = acc + r * kBlock;
        const int n = static_cast<int>(std::min<int64_t>(kManyR, rows - r));
        if (kInt4 && !dequantized) {
          switch (n) {
            case 1: int4_rows_group<1>(m, pairs, num_pairs, row, chunk, scale, offset, a); break;
            case 2: int4_rows_group<2>(m, pairs, num_pairs, row, chunk, scale, offset, a); break;
            case 3: int4_rows_group<3>(m, pairs, num_pairs, row, chunk, scale, offset, a); break;
            default: int4_rows_group<4>(m, pairs, num_pairs, row, chunk, scale, offset, a); break;
          }
        } else {
          switch (n) {
            case 1: rows_chunk<1>(m, pairs, num_pairs, row, k0, a); break;
            case 2: rows_chunk<2>(m, pairs, num_pairs, row, k0, a); break;
            case 3: rows_chunk<3>(m, pairs, num_pairs, row, k0, a); break;
            default: rows_chunk<4>(m, pairs, num_pairs, row, k0, a); break;
          }
        }
      }
      if (!kInt4 && (k_count & 1) && k0 + kManyChunk8 >= k_count) {
        // An odd in_features: the last feature (its pair's high half is 0) without reading x past
        // the row: x[k] times the low bf16 of each lane.
        const __m512i* last = pairs + 4 * num_pairs;
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 xv = _mm512_set1_ps(bf16_to_float(m.x[(slab + r) * m.x_stride + k_count - 1]));
          float* a = acc + r * kBlock;
          for (int c = 0; c < 4; ++c) {
            const __m512 wv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_load_si512(last + c), 16));
            _mm512_store_ps(a + 16 * c, _mm512_fmadd_ps(wv, xv, _mm512_load_ps(a + 16 * c)));
          }
        }
      }
    }
    finish_many(p, block, slab, rows, acc, !kInt4);
  }
}

template <bool kInt4>
CE_MANY int run_many_avx512(const Problem& p, const void* x, int64_t x_stride, int num_threads) {
  const int64_t k_count = p.in_features;
  ManyRows m{&p, static_cast<const uint16_t*>(x), x_stride, nullptr, 0};
  std::vector<float> x_sums;
  if constexpr (kInt4) {
    m.chunks = k_count / p.group_size;
    x_sums.resize(p.rows * m.chunks);
    prepare_x_sums(m.x, x_stride, p.rows, k_count, p.group_size, x_sums.data());
    m.x_sums = x_sums.data();
  } else {
    m.chunks = (k_count + kManyChunk8 - 1) / kManyChunk8;
  }
  const int64_t blocks = (p.out_features + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
#pragma omp parallel num_threads(threads)
  {
    alignas(64) __m512i pairs[4 * kManyMaxPairs];  // one chunk's widened weights (L1)
    alignas(64) float acc[kManySlab * kBlock];      // a slab's sums (L2)
    // kManyPanel rows at a time over every block, so a panel's x stays in L2 while the blocks stream
    // by (each block running all of a prefill's rows read them from memory once per block).
    for (int64_t row = 0; row < p.rows; row += kManyPanel) {
      const int64_t row_end = std::min(p.rows, row + kManyPanel);
#pragma omp for schedule(static)
      for (int64_t block = 0; block < blocks; ++block)
        many_rows_block_avx512<kInt4>(m, block, row, row_end, pairs, acc);
    }
  }
  return 0;
}
#endif

// ---- the tile path: many rows through AMX -------------------------------------------------------
//
// Past a few rows the GEMV's per-row work (widen the integers, multiply-add per row) is the cost,
// not the bytes: at 16 rows it ran 3-4x slower than oneDNN's bf16 GEMM. This path dequantizes a
// 64-output block to bf16 once (into a per-thread buffer that stays in L2) and multiplies every
// row by it on AMX (TDPBF16PS: 16 rows x 32 input features x 16 outputs an instruction), so the
// integers are read once per call whatever the row count. Activations must be bf16 (they go into
// the tiles as they are). int8 weights go in as their integers (exact in bf16) with the scale
// applied to the float32 sums; int4 weights as q * scale + offset rounded to bf16 (the rounding
// bf16 weights carry). Tile buffer layout: [K_pad / 32][4 tiles of 16 outputs][16 pairs][16][2].
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define CE_AMX_AVAILABLE 1
#define CE_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16,f16c,fma")))

constexpr int64_t kTileK = 32;     // bf16 input features per tile step
constexpr int64_t kTileRows = 16;  // rows per A tile
constexpr int64_t kPrefetchRows = 64;  // packed weight rows (64 bytes each) read ahead of use

using ce_amx::amx_permitted;
using ce_amx::TileConfig;

// 16 weights of input feature k (lo) and k + 1 (hi) -> 16 lanes of (bf16 lo, bf16 hi), as the B tile
// wants pairs of input features side by side.
CE_AMX inline __m512i interleave_bf16(__m512 lo, __m512 hi) {
  alignas(64) static const uint16_t kOrder[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                   8,  24, 9,  25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kOrder);
  return _mm512_permutexvar_epi16(order, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
}

// Input features [k_first, k_last) of a 64-output block, dequantized into B tiles at `tiles`.
CE_AMX void block_to_tiles(const Problem& p, bool int4, int64_t block, int64_t k_first, int64_t k_last,
                           uint16_t* tiles) {
  const int64_t k_count = p.in_features;
  const int64_t groups = int4 ? k_count / p.group_size : 0;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t k = k_first; k < k_last; k += 2) {
    uint16_t* row = tiles + (((k - k_first) / kTileK) * 4 * 16 + (k % kTileK) / 2) * 32;
    if (int4) {
      if (k >= k_count) {  // int4: k_count is even, so k + 1 is in too, and in the same group
        for (int j = 0; j < 4; ++j) _mm512_store_si512(row + j * 16 * 32, _mm512_setzero_si512());
        continue;
      }
      const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (k_count / 2) + k / 2) * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchRows * kBlock), _MM_HINT_T0);
      const int64_t at = (block * groups + k / p.group_size) * kBlock;
      for (int j = 0; j < 4; ++j) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j));
        const __m512 scale = _mm512_loadu_ps(p.scales + at + 16 * j);
        const __m512 offset = _mm512_loadu_ps(p.offsets + at + 16 * j);
        const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low_mask))), scale, offset);
        const __m512 hi = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low_mask))), scale, offset);
        _mm512_store_si512(row + j * 16 * 32, interleave_bf16(lo, hi));
      }
    } else {
      const int8_t* w = static_cast<const int8_t*>(p.packed) + block * k_count * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + kPrefetchRows) * kBlock), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + (k + 1 + kPrefetchRows) * kBlock), _MM_HINT_T0);
      for (int j = 0; j < 4; ++j) {
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        if (k < k_count)
          lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kBlock + 16 * j))));
        if (k + 1 < k_count)
          hi = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + 1) * kBlock + 16 * j))));
        _mm512_store_si512(row + j * 16 * 32, interleave_bf16(lo, hi));
      }
    }
  }
}

// Many rows: one 16-output tile of the block at a time, up to 4 row tiles (64 rows) per pass, so a
// step's B tile is dequantized once for all of them. C0..C3 are the row tiles' sums.
CE_AMX void column_tile_rows(const Problem& p, bool int4, const uint16_t* x_tiles, int64_t k_pad, int64_t block,
                             int j, int64_t row0, int row_tiles, float* sums, uint16_t* tile) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t k_count = p.in_features;
  const int64_t groups = int4 ? k_count / p.group_size : 0;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t k0 = 0; k0 < k_pad; k0 += kTileK) {
    for (int64_t k = k0; k < k0 + kTileK; k += 2) {
      __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
      if (int4) {
        if (k < k_count) {
          const uint8_t* w = static_cast<const uint8_t*>(p.packed) + (block * (k_count / 2) + k / 2) * kBlock;
          const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j));
          const int64_t at = (block * groups + k / p.group_size) * kBlock + 16 * j;
          const __m512 scale = _mm512_loadu_ps(p.scales + at), offset = _mm512_loadu_ps(p.offsets + at);
          lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low_mask))), scale, offset);
          hi = _mm512_fmadd_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low_mask))), scale, offset);
        }
      } else {
        const int8_t* w = static_cast<const int8_t*>(p.packed) + block * k_count * kBlock + 16 * j;
        if (k < k_count)
          lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kBlock))));
        if (k + 1 < k_count)
          hi = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k + 1) * kBlock))));
      }
      _mm512_store_si512(tile + (k - k0) / 2 * 32, interleave_bf16(lo, hi));
    }
    _tile_loadd(5, tile, 64);
    const uint16_t* x = x_tiles + row0 * k_pad + k0 * kTileRows;  // row tile row0 / 16's step k0 / 32
    const int64_t stride = 64, tile_rows = kTileRows * k_pad;
    _tile_loadd(4, x, stride);
    _tile_dpbf16ps(0, 4, 5);
    if (row_tiles > 1) {
      _tile_loadd(6, x + tile_rows, stride);
      _tile_dpbf16ps(1, 6, 5);
    }
    if (row_tiles > 2) {
      _tile_loadd(7, x + 2 * tile_rows, stride);
      _tile_dpbf16ps(2, 7, 5);
    }
    if (row_tiles > 3) {
      _tile_loadd(4, x + 3 * tile_rows, stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  // sums: [64 rows][64 outputs]; this tile's 16 outputs of each row tile.
  _tile_stored(0, sums + 16 * j, kBlock * 4);
  if (row_tiles > 1) _tile_stored(1, sums + 16 * kBlock + 16 * j, kBlock * 4);
  if (row_tiles > 2) _tile_stored(2, sums + 32 * kBlock + 16 * j, kBlock * 4);
  if (row_tiles > 3) _tile_stored(3, sums + 48 * kBlock + 16 * j, kBlock * 4);
}

// finish_block for bf16 outputs, 16 outputs a vector (the tile path's outputs are bf16).
CE_AMX void finish_block_bf16(const Problem& p, int64_t block, int64_t row0, int nrows, const float* acc,
                              bool scaled) {
  const int64_t first = block * kBlock;
  const int64_t count = std::min(kBlock, p.out_features - first);
  for (int r = 0; r < nrows; ++r) {
    uint16_t* out_row = static_cast<uint16_t*>(p.out) + (row0 + r) * p.out_features + first;
    for (int64_t f = 0; f < count; f += 16) {
      const __mmask16 mask = count - f >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - f)) - 1);
      __m512 v = _mm512_loadu_ps(acc + r * kBlock + f);
      if (scaled) v = _mm512_mul_ps(v, _mm512_loadu_ps(p.scales + first + f));
      if (p.bias != nullptr) {
        const __m256i b = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p.bias) + first + f);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
      }
      _mm256_mask_storeu_epi16(out_row + f, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

// One tile step: C0..C3 += A (16 rows x 32 features at `x`) x the step's 4 B tiles at `b`.
CE_AMX inline void tile_step(const uint16_t* x, int64_t x_stride_bytes, const uint16_t* b) {
  _tile_loadd(4, x, x_stride_bytes);
  _tile_loadd(5, b, 64);
  _tile_loadd(6, b + 16 * 32, 64);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(7, b + 2 * 16 * 32, 64);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, b + 3 * 16 * 32, 64);
  _tile_dpbf16ps(2, 4, 7);
  _tile_dpbf16ps(3, 4, 5);
}

// x_tiles: A tiles (run_tiles' layout), bf16, zero-padded. Up to 16 rows: all 4 output tiles at once, each
// step's B tiles dequantized just before use (they stay in L1). More rows: column_tile_rows, 64 rows
// a pass (the block's integers are in L2 after the first output tile).
CE_AMX void tile_block(const Problem& p, bool int4, const uint16_t* x_tiles, int64_t k_pad, int64_t block,
                       uint16_t* tiles) {
  const int64_t steps = k_pad / kTileK;
  alignas(64) float sums[4 * kTileRows * kBlock];
  if (p.rows <= kTileRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t step = 0; step < steps; ++step) {
      block_to_tiles(p, int4, block, step * kTileK, (step + 1) * kTileK, tiles);
      tile_step(x_tiles + step * kTileK * kTileRows, 64, tiles);
    }
    _tile_stored(0, sums, kBlock * 4);
    _tile_stored(1, sums + 16, kBlock * 4);
    _tile_stored(2, sums + 32, kBlock * 4);
    _tile_stored(3, sums + 48, kBlock * 4);
    finish_block_bf16(p, block, 0, static_cast<int>(p.rows), sums, !int4);
    return;
  }
  for (int64_t row0 = 0; row0 < p.rows; row0 += 4 * kTileRows) {
    const int64_t rows = std::min(4 * kTileRows, p.rows - row0);
    const int row_tiles = static_cast<int>((rows + kTileRows - 1) / kTileRows);
    for (int j = 0; j < 4; ++j) column_tile_rows(p, int4, x_tiles, k_pad, block, j, row0, row_tiles, sums, tiles);
    for (int64_t r = 0; r < rows; r += kTileRows)
      finish_block_bf16(p, block, row0 + r, static_cast<int>(std::min(kTileRows, rows - r)), sums + r * kBlock, !int4);
  }
}

CE_AMX int run_tiles(const Problem& p, bool int4, const void* x, int64_t x_stride, int num_threads) {
  const int64_t k_pad = (p.in_features + kTileK - 1) / kTileK * kTileK;
  const int64_t rows_pad = (p.rows + kTileRows - 1) / kTileRows * kTileRows;
  // x as A tiles, [rows_pad / 16][k_pad / 32][16 rows][32 features], zero-padded: each tile load
  // reads one contiguous KB. (From a row-major copy, 16 rows k_pad * 2 bytes apart, the same loads
  // ran slower: about a tenth of int8's tile time at 64 rows, docs/quantization.md.)
  std::vector<uint16_t> x_tiles(rows_pad * k_pad, 0);
  for (int64_t r = 0; r < p.rows; ++r) {
    const uint16_t* src = static_cast<const uint16_t*>(x) + r * x_stride;
    uint16_t* dst = x_tiles.data() + (r / kTileRows) * kTileRows * k_pad + (r % kTileRows) * kTileK;
    int64_t k0 = 0;
    for (; k0 + kTileK <= p.in_features; k0 += kTileK)
      _mm512_storeu_si512(dst + k0 * kTileRows, _mm512_loadu_si512(src + k0));
    if (k0 < p.in_features) {  // the last, partial step: the rest of the row, zeros after it
      const __mmask32 keep = static_cast<__mmask32>((1ull << (p.in_features - k0)) - 1);
      _mm512_storeu_si512(dst + k0 * kTileRows, _mm512_maskz_loadu_epi16(keep, src + k0));
    }
  }
  const int64_t blocks = (p.out_features + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
#pragma omp parallel num_threads(threads)
  {
    TileConfig config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
    alignas(64) uint16_t tiles[kTileK * kBlock];  // one step's 4 B tiles
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) tile_block(p, int4, x_tiles.data(), k_pad, block, tiles);
    _tile_release();
  }
  return 0;
}
#endif
#endif

#if defined(__x86_64__)
// 8 floats of a bf16 (dtype 1) or fp16 (2) row.
CE_AVX2 inline __m256 load8_half(const uint16_t* p, int dtype) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (dtype == kBFloat16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  return _mm256_cvtph_ps(v);
}

CE_AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

CE_AVX2 inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// x rounded to T per `chunk` inputs of each bf16 / fp16 row (row stride x_stride; in_features and
// chunk multiples of 8): q = round(x / s), ties to even, s = max|x| / (T's largest value) (scales,
// [rows, chunks]); where `sums` is not null, also the sum of x over each `sum_span` inputs (a
// multiple of chunk; [rows, in_features / sum_span]). The rows are shared among `threads`.
// int16 (the integer GEMV loops' x16, chunk kX16Chunk or int4's group, the group's sums): the same
// x16 and scales as the scalar loops in `run`, which take other sizes (the sums are added in
// another order). int8 (many_rows_block_quads' x8, chunk kQuadChunkK, int4's group sums).
template <typename T>
CE_AVX2 void round_rows(const void* x, int64_t x_stride, int64_t rows, int64_t k_count, int64_t chunk,
                        int64_t sum_span, int dtype, int threads, T* q, float* scales, float* sums) {
  static_assert(std::is_same_v<T, int8_t> || std::is_same_v<T, int16_t>);
  constexpr float kLimit = std::is_same_v<T, int8_t> ? 127.0f : 32767.0f;
  const int64_t chunks = (k_count + chunk - 1) / chunk;
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* in = static_cast<const uint16_t*>(x) + r * x_stride;
    __m256 span_sum = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t k0 = c * chunk, k1 = std::min(k_count, k0 + chunk);
      __m256 amax = _mm256_setzero_ps();
      for (int64_t k = k0; k < k1; k += 8) {
        const __m256 v = load8_half(in + k, dtype);
        span_sum = _mm256_add_ps(span_sum, v);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v, magnitude));
      }
      const float m = max8(amax);
      const float scale = m > 0.0f ? m / kLimit : 1.0f;
      const __m256 inv = _mm256_set1_ps(1.0f / scale);
      T* out = q + r * k_count;
      for (int64_t k = k0; k < k1; k += 8) {
        const __m256i n = _mm256_cvtps_epi32(_mm256_mul_ps(load8_half(in + k, dtype), inv));  // nearest, ties to even
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
        if constexpr (std::is_same_v<T, int16_t>)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), words);
        else
          _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(words, words));
      }
      scales[r * chunks + c] = scale;
      if (sums != nullptr && k1 % sum_span == 0) {
        sums[r * (k_count / sum_span) + k1 / sum_span - 1] = sum8(span_sum);
        span_sum = _mm256_setzero_ps();
      }
    }
  }
}

// int4, many rows, AVX2, bf16 / fp16 x, groups a multiple of 32: x in int8 (round_rows), then
// many_rows_block_quads block by block.
int run_quads(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
              const float* offsets, int64_t group_size, const void* bias, void* out, int64_t in_features,
              int64_t out_features, int dtype, int num_threads, const uint32_t* scale_zero) {
  const int64_t groups = in_features / group_size;
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  std::vector<int8_t> x8(rows * in_features);
  std::vector<float> x8_scales(rows * (in_features / kQuadChunkK)), x_sums(rows * groups);
  round_rows(x, x_stride, rows, in_features, kQuadChunkK, group_size, dtype, std::max(1, num_threads), x8.data(),
             x8_scales.data(), x_sums.data());
  Problem p{nullptr, x_sums.data(), nullptr, nullptr, rows, packed, scales, offsets, group_size,
            bias, out, in_features, out_features, dtype, scale_zero, x8.data(), x8_scales.data()};
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> sums(std::min(kSlabRows, rows) * kBlock);
#pragma omp for schedule(static)
    for (int64_t block = 0; block < blocks; ++block) many_rows_block_quads(p, block, sums.data());
  }
  return 0;
}
#endif

template <bool kInt4>
void run_block(const Problem& p, int64_t block, int64_t row0, int nrows, int isa) {
#if defined(__x86_64__)
  if (isa == 1 && p.x16 != nullptr) {
    switch (nrows) {
      case 1: return block_avx2<1, 4, kInt4, true>(p, block, row0);
      case 2: return block_avx2<2, 2, kInt4, true>(p, block, row0);
      case 3: return block_avx2<3, 1, kInt4, true>(p, block, row0);
      default: return block_avx2<4, 1, kInt4, true>(p, block, row0);
    }
  }
  if (isa == 1) {
    switch (nrows) {
      case 1: return block_avx2<1, 8, kInt4, false>(p, block, row0);
      case 2: return block_avx2<2, 4, kInt4, false>(p, block, row0);
      case 3: return block_avx2<3, 4, kInt4, false>(p, block, row0);
      default: return block_avx2<4, 2, kInt4, false>(p, block, row0);
    }
  }
  if (isa >= 2) {
    if constexpr (kInt4) {
#if defined(__AVX512VNNI__)
      if (p.x16 != nullptr) {
        switch (nrows) {
          case 1: return int4_block_vnni<1>(p, block, row0);
          case 2: return int4_block_vnni<2>(p, block, row0);
          case 3: return int4_block_vnni<3>(p, block, row0);
          default: return int4_block_vnni<4>(p, block, row0);
        }
      }
#endif
      switch (nrows) {
        case 1: return int4_block_avx512<1>(p, block, row0);
        case 2: return int4_block_avx512<2>(p, block, row0);
        case 3: return int4_block_avx512<3>(p, block, row0);
        default: return int4_block_avx512<4>(p, block, row0);
      }
    } else {
#if defined(__AVX512VNNI__)
      if (p.x16 != nullptr) {
        switch (nrows) {
          case 1: return int8_block_vnni<1>(p, block, row0);
          case 2: return int8_block_vnni<2>(p, block, row0);
          case 3: return int8_block_vnni<3>(p, block, row0);
          default: return int8_block_vnni<4>(p, block, row0);
        }
      }
#endif
      switch (nrows) {
        case 1: return int8_block_avx512<1>(p, block, row0);
        case 2: return int8_block_avx512<2>(p, block, row0);
        case 3: return int8_block_avx512<3>(p, block, row0);
        default: return int8_block_avx512<4>(p, block, row0);
      }
    }
  }
#endif
  if constexpr (kInt4) int4_block_portable(p, block, row0, nrows);
  else int8_block_portable(p, block, row0, nrows);
}

template <bool kInt4>
int run(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
        const float* offsets, int64_t group_size, const void* bias, void* out, int64_t in_features,
        int64_t out_features, int dtype, int isa, int num_threads, bool many_rows = false,
        const uint32_t* scale_zero = nullptr) {
  if (rows < 0 || in_features < 1 || out_features < 1 || dtype < 0 || dtype > 2) return 1;
  if (kInt4 && (group_size < 2 || group_size % 2 || in_features % group_size)) return 1;
  if (rows == 0) return 0;
#if defined(__x86_64__)
  if (kInt4 && many_rows && isa == 1 && rows >= kDequantizeOnceRows && dtype != kFloat32 &&
      group_size % kQuadChunkK == 0)
    return run_quads(x, x_stride, rows, packed, scales, offsets, group_size, bias, out, in_features, out_features,
                     dtype, num_threads, scale_zero);
#endif
  const int64_t groups = kInt4 ? in_features / group_size : 0;
  std::vector<float> x_float, x_sums(rows * groups, 0.0f);
  // The integer paths (AVX2's vpmaddwd, AVX-512's VNNI) for bf16 / fp16 activations and even
  // in_features: x in int16 per chunk (kX16Chunk; int4: per group); float32 activations keep the
  // float paths' exact products.
  std::vector<int16_t> x16;
  std::vector<float> x16_scales;
  const int64_t chunk_size = kInt4 ? group_size : kX16Chunk;
  const int64_t chunks = (in_features + chunk_size - 1) / chunk_size;
#if defined(__x86_64__)
#if defined(__AVX512VNNI__)
  const bool integer_isa = isa >= 1;
#else
  const bool integer_isa = isa == 1;
#endif
  const bool integer =
      integer_isa && dtype != kFloat32 && in_features % 2 == 0 && (!kInt4 || group_size <= kMaxX16Group);
#else
  const bool integer = false;
#endif
  // Sizes of 8s: x16 straight from the bf16 / fp16 rows, vectorized (the integer loops read
  // nothing else); otherwise through x as float32.
  const bool vectorized = integer && in_features % 8 == 0 && chunk_size % 8 == 0;
  if (integer) {
    x16.resize(rows * in_features);
    x16_scales.resize(rows * chunks);
  }
#if defined(__x86_64__)
  if (vectorized)
    round_rows(x, x_stride, rows, in_features, chunk_size, chunk_size, dtype,
               rows >= kDequantizeOnceRows ? std::max(1, num_threads) : 1, x16.data(), x16_scales.data(),
               kInt4 ? x_sums.data() : nullptr);
#endif
  if (!vectorized) {
    // x once as float32 (and, for int4, its per-group sums: the offsets' multiplier).
    x_float.resize(rows * in_features);
    for (int64_t r = 0; r < rows; ++r) {
      const char* row = static_cast<const char*>(x) + r * x_stride * (dtype == kFloat32 ? 4 : 2);
      for (int64_t k = 0; k < in_features; ++k) x_float[r * in_features + k] = load_any(row, k, dtype);
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t k = 0; k < group_size; ++k) x_sums[r * groups + g] += x_float[r * in_features + g * group_size + k];
  }
  if (integer && !vectorized) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < chunks; ++c) {
        const float* xr = x_float.data() + r * in_features;
        const int64_t k0 = c * chunk_size, k1 = std::min(in_features, k0 + chunk_size);
        float amax = 0.0f;
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
        const float scale = amax > 0.0f ? amax / 32767.0f : 1.0f;
        const float inv = 1.0f / scale;
        for (int64_t k = k0; k < k1; ++k) x16[r * in_features + k] = static_cast<int16_t>(std::nearbyint(xr[k] * inv));
        x16_scales[r * chunks + c] = scale;
      }
  }
  Problem p{x_float.empty() ? nullptr : x_float.data(), x_sums.data(), x16.empty() ? nullptr : x16.data(),
            x16_scales.empty() ? nullptr : x16_scales.data(), rows, packed, scales, offsets, group_size,
            bias, out, in_features, out_features, dtype, isa >= 1 ? scale_zero : nullptr};
  const int64_t blocks = (out_features + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, blocks)));
#if defined(__x86_64__)
  if (many_rows && isa == 1 && rows >= kDequantizeOnceRows) {
#pragma omp parallel num_threads(threads)
    {
      std::vector<float> sums(std::min(kSlabRows, rows) * kBlock);
#pragma omp for schedule(static)
      for (int64_t block = 0; block < blocks; ++block) {
        if (p.x16 != nullptr) many_rows_block_madd<kInt4>(p, block, sums.data());
        else many_rows_block_avx2<kInt4>(p, block, sums.data());
      }
    }
    return 0;
  }
#endif
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t block = 0; block < blocks; ++block)
    for (int64_t row0 = 0; row0 < rows; row0 += kMaxRows)
      run_block<kInt4>(p, block, row0, static_cast<int>(std::min<int64_t>(kMaxRows, rows - row0)), isa);
  return 0;
}

// The tile path (`isa` >= 4) where this build and CPU have AMX and x is bf16; `isa` 3 (AVX-512 BF16)
// with bf16 x: the widen-once path (many_rows_block_avx512) where the build has VNNI and BF16; on
// AVX2 (`isa` 1) the dequantize-once path (many_rows_block_avx2); the GEMV's otherwise.
template <bool kInt4>
int run_many_rows(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                  const float* offsets, int64_t group_size, const void* bias, void* out, int64_t in_features,
                  int64_t out_features, int dtype, int isa, int num_threads, const uint32_t* scale_zero = nullptr) {
#if defined(CE_AMX_AVAILABLE)
  if (isa >= 4 && dtype == kBFloat16 && rows > 0 && in_features > 0 && out_features > 0 && amx_permitted()) {
    if (kInt4 && (group_size < 2 || group_size % 2 || in_features % group_size)) return 1;
    const Problem p{nullptr, nullptr, nullptr, nullptr, rows, packed, scales, offsets, group_size,
                    bias, out, in_features, out_features, dtype};
    return run_tiles(p, kInt4, x, x_stride, num_threads);
  }
#endif
#if defined(CE_MANY_AVX512_AVAILABLE)
  if (isa == 3 && dtype == kBFloat16) {
    if (rows < 0 || in_features < 1 || out_features < 1) return 1;
    if (kInt4 && (group_size < 2 || group_size % 2 || in_features % group_size)) return 1;
    if (rows == 0) return 0;
    if (kInt4 && group_size / 2 > kManyMaxPairs)  // a group wider than the buffer: the GEMV's loops
      return run<kInt4>(x, x_stride, rows, packed, scales, offsets, group_size, bias, out, in_features,
                        out_features, dtype, 2, num_threads, true, scale_zero);
    const Problem p{nullptr, nullptr, nullptr, nullptr, rows, packed, scales, offsets, group_size,
                    bias, out, in_features, out_features, dtype, scale_zero};
    return run_many_avx512<kInt4>(p, x, x_stride, num_threads);
  }
#endif
  return run<kInt4>(x, x_stride, rows, packed, scales, offsets, group_size, bias, out, in_features, out_features,
                    dtype, std::min(isa, 3), num_threads, true, scale_zero);
}

}  // namespace

extern "C" {

// 1 where the tile path can run here (built with AMX BF16 and granted the AMX state), else 0.
int ce_cpu_gemm_tiles_available() {
#if defined(CE_AMX_AVAILABLE)
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// 1 where the AVX-512 widen-once path is built in (AVX-512 BF16; the caller checks the CPU), else 0.
int ce_cpu_gemm_avx512_available() {
#if defined(CE_MANY_AVX512_AVAILABLE)
  return 1;
#else
  return 0;
#endif
}

// As ce_cpu_gemv_int8 / _int4, for many rows: `isa` 4 takes the tile path, 3 the AVX-512 widen-once one
// (bf16 x), 1 the AVX2 dequantize-once one (see run_many_rows).
int ce_cpu_gemm_int8(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const void* bias, void* out, int64_t in_features, int64_t out_features, int dtype, int isa,
                     int num_threads) {
  return run_many_rows<false>(x, x_stride, rows, packed, scales, nullptr, 0, bias, out, in_features, out_features,
                              dtype, isa, num_threads);
}

int ce_cpu_gemm_int4(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const float* offsets, int64_t group_size, const void* bias, void* out, int64_t in_features,
                     int64_t out_features, int dtype, int isa, int num_threads, const uint32_t* scale_zero) {
  return run_many_rows<true>(x, x_stride, rows, packed, scales, offsets, group_size, bias, out, in_features,
                             out_features, dtype, isa, num_threads, scale_zero);
}

// Both return 0, or 1 for bad arguments. `isa` as in the header (the caller checked the CPU has it).
// int4's `scale_zero`: the packed bf16 scales and zeros (Problem::scale_zero), or null.
int ce_cpu_gemv_int8(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const void* bias, void* out, int64_t in_features, int64_t out_features, int dtype, int isa,
                     int num_threads) {
  return run<false>(x, x_stride, rows, packed, scales, nullptr, 0, bias, out, in_features, out_features, dtype,
                    isa, num_threads);
}

int ce_cpu_gemv_int4(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const float* offsets, int64_t group_size, const void* bias, void* out, int64_t in_features,
                     int64_t out_features, int dtype, int isa, int num_threads, const uint32_t* scale_zero) {
  return run<true>(x, x_stride, rows, packed, scales, offsets, group_size, bias, out, in_features,
                   out_features, dtype, isa, num_threads, false, scale_zero);
}

}  // extern "C"
