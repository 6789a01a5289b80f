// The CPU kernels' ops, registered with torch's dispatcher in C++: `compiled_engine::cpu_gemv`
// (kernels/cpu_gemv.cpp), `compiled_engine::paged_attention_cpu` (kernels/cpu_attention.cpp),
// `compiled_engine::onednn_linear` (oneDNN's packed linear, kernels/onednn_linear.py) and the
// quantized linears `cpu_gemv_int8` / `_int4` and `cpu_gemm_int8` / `_int4`
// (kernels/cpu_gemv_quantized.cpp).
//
// Why: the Python implementations of these ops (kernels/cpu_gemv.py, kernels/cpu_attention.py,
// kernels/onednn_linear.py, kernels/cpu_gemv_quantized.py) cost 7-21 us a call around kernels of
// ~8 us (bench/test_op_call.py), and a decode step makes ~30 such calls (~100 for a 24-layer
// model). Here a call is the dispatcher's plus a few checks. The ops' schemas and fake (meta)
// implementations stay in Python; this file only adds CPU kernels.
//
// Built at first use by kernels/cpu_ops.py, together with the three kernel sources (one
// shared library, linked against the running torch) and loaded with torch.ops.load_library, which
// runs the TORCH_LIBRARY_IMPL block below. The checks and messages mirror the Python ones, which
// stay as the fallback where this library cannot be built.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

extern "C" int ce_cpu_gemv(const void* x, int64_t x_stride, int64_t rows, const void* packed, const void* bias,
                           void* out, int64_t in_features, int64_t out_features, int dtype, int isa,
                           int num_threads);
extern "C" int ce_cpu_paged_attention(const int64_t* ints, float scale, float softcap);
// kernels/cpu_gemv_quantized.cpp's entry points: the GEMV (a few rows) and the many-rows path, of
// int8 and int4 weights (one signature per scheme).
extern "C" {
int ce_cpu_gemv_int8(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const void* bias, void* out, int64_t in_features, int64_t out_features, int dtype, int isa,
                     int num_threads);
int ce_cpu_gemm_int8(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const void* bias, void* out, int64_t in_features, int64_t out_features, int dtype, int isa,
                     int num_threads);
int ce_cpu_gemv_int4(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const float* offsets, int64_t group_size, const void* bias, void* out, int64_t in_features,
                     int64_t out_features, int dtype, int isa, int num_threads, const uint32_t* scale_zero);
int ce_cpu_gemm_int4(const void* x, int64_t x_stride, int64_t rows, const void* packed, const float* scales,
                     const float* offsets, int64_t group_size, const void* bias, void* out, int64_t in_features,
                     int64_t out_features, int dtype, int isa, int num_threads, const uint32_t* scale_zero);
}

namespace {

// The GEMV's instruction-set path (kernels/cpu_gemv.py's gemv_isa), set once after loading.
std::atomic<int> g_isa{0};

int dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

// ---- cpu_gemv ---------------------------------------------------------------------------------

constexpr int64_t kBlock = 64;  // output features per packed block (kBlock in cpu_gemv.cpp)

// The layout kernels/cpu_gemv.py's pack_gemv_weight documents: features padded to blocks of 64,
// k padded to even; float32/float16 [blocks, K, 64], bfloat16 [blocks, K / 2, 64, 2].
at::Tensor pack(const at::Tensor& weight) {
  c10::NoGradGuard no_grad;
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const int64_t blocks = (out_features + kBlock - 1) / kBlock, k_padded = in_features + (in_features & 1);
  at::Tensor padded = at::zeros({blocks * kBlock, k_padded}, weight.options());
  padded.narrow(0, 0, out_features).narrow(1, 0, in_features).copy_(weight);
  if (weight.scalar_type() == at::kBFloat16) {
    return padded.view({blocks, kBlock, k_padded / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  return padded.view({blocks, kBlock, k_padded}).permute({0, 2, 1}).contiguous();
}

// Packed copies by weight, as kernels/cpu_gemv.py's PackedGemvWeights: the weight held weakly,
// the copy remade when a version counter moved (an in-place change). `Packed`: what a copy holds
// (one tensor, or the quantized layouts' several); `Version`: the counters it was made at.
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
template <typename Packed, typename Version>
struct PackedCopy {
  WeakImpl weight;
  Version version;
  Packed packed;
};
template <typename Packed, typename Version>
using PackedCopies = std::unordered_map<const c10::TensorImpl*, PackedCopy<Packed, Version>>;
using TensorCopies = PackedCopies<at::Tensor, int64_t>;
std::mutex g_packed_mutex;
TensorCopies g_packed;

int64_t version_of(const at::Tensor& weight) {  // -1: an inference tensor (no counter, never changes)
  return weight.is_inference() ? -1 : static_cast<int64_t>(weight._version());
}

// `weight`'s copy in `copies` (made by `make()` if missing or stale), under `mutex`.
template <typename Packed, typename Version, typename Make>
Packed packed_copy(std::mutex& mutex, PackedCopies<Packed, Version>& copies, const at::Tensor& weight,
                   const Version& version, Make make) {
  const c10::TensorImpl* key = weight.unsafeGetTensorImpl();
  std::lock_guard<std::mutex> lock(mutex);
  auto found = copies.find(key);
  // A live weak reference means `key` is still this weight, not a new one at a reused address.
  if (found != copies.end() && !found->second.weight.expired() && found->second.version == version) {
    return found->second.packed;
  }
  for (auto it = copies.begin(); it != copies.end();) {  // drop the copies of dead weights
    it = it->second.weight.expired() ? copies.erase(it) : std::next(it);
  }
  Packed packed = make();
  copies.insert_or_assign(key, PackedCopy<Packed, Version>{WeakImpl(weight.getIntrusivePtr()), version, packed});
  return packed;
}

at::Tensor packed_copy(std::mutex& mutex, TensorCopies& copies, const at::Tensor& weight,
                       at::Tensor (*make)(const at::Tensor&)) {
  return packed_copy(mutex, copies, weight, version_of(weight), [&] { return make(weight); });
}

template <typename Packed, typename Version>
int64_t live_copies(std::mutex& mutex, const PackedCopies<Packed, Version>& copies) {
  std::lock_guard<std::mutex> lock(mutex);
  int64_t live = 0;
  for (const auto& entry : copies) live += entry.second.weight.expired() ? 0 : 1;
  return live;
}

// An op's output of `sizes` and `like`'s dtype: `out` when given (a step plan's buffer, below:
// checked to be that shape and dtype, contiguous; `what` names it in the error), else a new tensor.
at::Tensor output_of(c10::IntArrayRef sizes, const at::Tensor& like, const at::Tensor& out, const char* what) {
  if (!out.defined()) return at::empty(sizes, like.options());
  TORCH_CHECK_VALUE(out.sizes() == sizes && out.scalar_type() == like.scalar_type() && out.is_contiguous(), what,
                    " must be a contiguous ", like.scalar_type(), " ", sizes, ", got ", out.scalar_type(), " ",
                    out.sizes());
  return out;
}

// The output of a linear over x's rows with `features` outputs (output_of).
at::Tensor output_for(const at::Tensor& x, int64_t features, const at::Tensor& out) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = features;
  return output_of(sizes, x, out, "a linear's output");
}

at::Tensor cpu_gemv_into(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& out_in) {
  TORCH_CHECK_VALUE(weight.dim() == 2, "a linear weight is 2-D, got shape ", weight.sizes());
  const int code = dtype_code(weight.scalar_type());
  TORCH_CHECK_VALUE(code >= 0, "cpu_gemv packs float32, bfloat16 or float16 CPU weights, got ",
                    weight.scalar_type());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type() &&
                        (!bias.has_value() || bias->scalar_type() == weight.scalar_type()),
                    "cpu_gemv needs x, weight and bias of one dtype, got ", x.scalar_type(), ", ",
                    weight.scalar_type(), ", ", bias.has_value() ? c10::toString(bias->scalar_type()) : "None");
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == in_features, "cpu_gemv: x has ", x.dim() ? x.size(-1) : 0,
                    " features, the weight takes ", in_features);
  std::optional<at::Tensor> bias_rows;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->numel() == out_features, "cpu_gemv: bias has ", bias->numel(),
                      " values, the weight has ", out_features, " outputs");
    bias_rows = bias->contiguous();
  }
  at::Tensor rows = x.reshape({-1, in_features});
  if (rows.stride(1) != 1 || (rows.size(0) > 1 && rows.stride(0) < in_features)) rows = rows.contiguous();
  at::Tensor out = output_for(x, out_features, out_in);
  const at::Tensor packed = packed_copy(g_packed_mutex, g_packed, weight, pack);
  const int rc = ce_cpu_gemv(rows.data_ptr(), rows.stride(0), rows.size(0), packed.data_ptr(),
                             bias_rows.has_value() ? bias_rows->data_ptr() : nullptr, out.data_ptr(), in_features,
                             out_features, code, g_isa.load(std::memory_order_relaxed), at::get_num_threads());
  TORCH_CHECK(rc == 0, "cpu_gemv: the kernel rejected its arguments (code ", rc, ")");
  return out;
}

at::Tensor cpu_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return cpu_gemv_into(x, weight, bias, at::Tensor());
}

// ---- onednn_linear ----------------------------------------------------------------------------

// oneDNN's ops, called boxed by name: their C++ signatures are not public headers and have
// changed across torch versions; the schemas have not.
c10::OperatorHandle mkldnn_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor reorder_linear_weight(const at::Tensor& weight) {  // kernels/onednn_linear.py's pack_linear_weight
  TORCH_CHECK_VALUE(weight.dim() == 2, "a linear weight is 2-D, got shape ", weight.sizes());
  static const c10::OperatorHandle reorder = mkldnn_op("mkldnn::_reorder_linear_weight");
  c10::NoGradGuard no_grad;
  torch::jit::Stack stack{weight.contiguous(), c10::IValue()};
  reorder.callBoxed(&stack);
  return std::move(stack.back()).toTensor();
}

// Packed copies by weight, as PackedCopies above (kernels/onednn_linear.py's PackedWeights).
std::mutex g_onednn_mutex;
TensorCopies g_onednn_packed;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle linear = mkldnn_op("mkldnn::_linear_pointwise");
  const at::Tensor packed = packed_copy(g_onednn_mutex, g_onednn_packed, weight, reorder_linear_weight);
  torch::jit::Stack stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
  linear.callBoxed(&stack);
  return std::move(stack.back()).toTensor();
}

// ---- cpu_gemv_int8 / _int4, cpu_gemm_int8 / _int4 ----------------------------------------------

// The quantized kernels' paths (kernels/cpu_gemv_quantized.py, set once after loading): the GEMV's
// (its `_checked_rows`), and the many-rows ops' for bf16 x (its `_tile_path`: the AMX tiles, the
// AVX-512 widen-once path, else the GEMV's); other activations take the GEMV's path there too.
std::atomic<int> g_quantized_gemv_path{0};
std::atomic<int> g_quantized_bf16_many_rows_path{0};
// Half-precision dtypes whose GEMMs torch runs without a native path here (bit 0: bf16, bit 1:
// fp16; kernels/widened_linear.py's widened_dtypes_code): the dequantize-once path widens them.
std::atomic<int> g_widened_dtypes{0};

// [N, ...] -> [ceil(N / 64) * 64, ...], padded with `fill` (cpu_gemv_quantized.py's _blocks).
at::Tensor in_blocks(const at::Tensor& rows, double fill) {
  const int64_t n = rows.size(0), padded = (n + kBlock - 1) / kBlock * kBlock;
  if (padded == n) return rows;
  std::vector<int64_t> pad(2 * rows.dim(), 0);
  pad.back() = padded - n;  // constant_pad_nd's pairs run from the last dimension to the first
  return at::constant_pad_nd(rows, pad, fill);
}

// The layouts of cpu_gemv_quantized.py's pack_int8 / pack_int4 (which document them).
std::vector<at::Tensor> pack_int8(const at::Tensor& qweight, const at::Tensor& scales) {
  c10::NoGradGuard no_grad;
  const at::Tensor q = in_blocks(qweight, 0);
  return {q.view({-1, kBlock, q.size(1)}).permute({0, 2, 1}).contiguous(),
          in_blocks(scales.to(at::kFloat).unsqueeze(1), 0).view({-1, kBlock}).contiguous()};
}

std::vector<at::Tensor> pack_int4(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& zeros) {
  c10::NoGradGuard no_grad;
  const at::Tensor q = in_blocks(qweight, 0x88);  // padded features: q = 8 everywhere, scale 0, offset 0
  const at::Tensor s = scales.to(at::kFloat), z = zeros.to(at::kFloat);
  const int64_t groups = s.size(1);
  auto as_blocks = [&](const at::Tensor& t) {
    return in_blocks(t, 0).view({-1, kBlock, groups}).permute({0, 2, 1}).contiguous();
  };
  std::vector<at::Tensor> packed{q.view({-1, kBlock, q.size(1)}).permute({0, 2, 1}).contiguous(), as_blocks(s),
                                 as_blocks(z.sub(s.mul(8)))};
  if (scales.scalar_type() == at::kBFloat16 && zeros.scalar_type() == at::kBFloat16) {
    auto bits = [](const at::Tensor& t) { return t.contiguous().view(at::kShort).to(at::kInt).bitwise_and(0xFFFF); };
    packed.push_back(as_blocks(bits(scales).bitwise_or(bits(zeros).bitwise_left_shift(16))));
  }
  return packed;
}

// Packed copies by quantized weight; the version holds the counters of qweight, scales and zeros.
using QuantizedCopies = PackedCopies<std::vector<at::Tensor>, std::array<int64_t, 3>>;
std::mutex g_quantized_mutex;
QuantizedCopies g_quantized;

// x's rows (contiguous), bias (contiguous, x's dtype) and the output, checked as
// cpu_gemv_quantized.py's _checked_rows and _bias check them.
struct QuantizedCall {
  at::Tensor rows;
  std::optional<at::Tensor> bias;
  at::Tensor out;
  int dtype;
};

QuantizedCall quantized_call(const at::Tensor& x, int64_t in_features, int64_t out_features,
                             const std::optional<at::Tensor>& bias, bool allocate_out, const at::Tensor& out) {
  const int code = dtype_code(x.scalar_type());
  TORCH_CHECK_VALUE(code >= 0, "cpu_gemv_quantized takes float32, bfloat16 or float16 activations, got ",
                    x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) == in_features, "cpu_gemv_quantized: x has ",
                    x.dim() ? x.size(-1) : 0, " features, the weight takes ", in_features);
  std::optional<at::Tensor> bias_rows;
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->scalar_type() == x.scalar_type(), "cpu_gemv_quantized: bias is ", bias->scalar_type(),
                      ", x is ", x.scalar_type());
    TORCH_CHECK_VALUE(bias->numel() == out_features, "cpu_gemv_quantized: bias has ", bias->numel(),
                      " values, the weight has ", out_features, " outputs");
    bias_rows = bias->contiguous();
  }
  at::Tensor rows = x.reshape({-1, in_features});
  if (!rows.is_contiguous()) rows = rows.contiguous();
  return {rows, bias_rows, allocate_out ? output_for(x, out_features, out) : at::Tensor(), code};
}

int quantized_path(const at::Tensor& x, bool many_rows) {
  return many_rows && x.scalar_type() == at::kBFloat16 ? g_quantized_bf16_many_rows_path.load(std::memory_order_relaxed)
                                                       : g_quantized_gemv_path.load(std::memory_order_relaxed);
}

// Many rows (a prompt's): the weight dequantized once into x's dtype, then torch's GEMM (oneDNN).
// The kernels' tile path dequantizes each 64-output block once but re-reads every row of x for
// each block: past a few hundred rows x leaves L2, and at 4,096 rows the tiles took 2.4-2.6x bf16's
// time against 1.2-1.3x this way (bench/test_quantized_many_rows.py, docs/quantization.md): the
// dequantization, a pass over the weight, is a small part of the GEMM there. Fewer rows keep the
// kernels (cpu_gemv_quantized.py's DEQUANTIZE_ROWS does the same).
constexpr int64_t kDequantizeRows = 512;
constexpr int kAvx2Path = 1;            // the kernels' `isa` for AVX2 (kernels/cpu_gemv.py's ISA_AVX2)
constexpr int64_t kInt8XInputs = 32;    // cpu_gemv_quantized.py's INT8_X_INPUTS

template <typename T>
inline T from_float(float v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t bits;  // round to nearest even, as torch's conversion (the values are finite)
    std::memcpy(&bits, &v, sizeof bits);
    return c10::BFloat16(static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16), c10::BFloat16::from_bits());
  } else {
    return T(v);
  }
}

// kernels/weight_quantization.py's dequantize, into `T`: q * scale (int8), (q - 8) * scale + zero
// (int4, per group), in float32 as there, then rounded to T. The library is built with
// -ffp-contract=off (kernels/cpu_ops.py), so the multiply and the add round apart, as torch's two ops.
template <typename T>
void dequantize_rows(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor* zeros, int64_t group_size,
                     at::Tensor& out) {
  const int64_t n = out.size(0), k = out.size(1);
  const at::Tensor codes = qweight.contiguous();
  const at::Tensor s = scales.to(at::kFloat).contiguous();
  const at::Tensor z = zeros != nullptr ? zeros->to(at::kFloat).contiguous() : at::Tensor();
  const float* sp = s.data_ptr<float>();
  const float* zp = zeros != nullptr ? z.data_ptr<float>() : nullptr;
  T* op = out.data_ptr<T>();
  if (zeros == nullptr) {
    const int8_t* q = codes.data_ptr<int8_t>();
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t c = 0; c < k; ++c) op[r * k + c] = from_float<T>(static_cast<float>(q[r * k + c]) * sp[r]);
    });
    return;
  }
  const uint8_t* q = codes.data_ptr<uint8_t>();
  const int64_t groups = k / group_size;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (group_size % 32 == 0) {  // 32 features (16 bytes) a vector step; the same maths and rounding
      const __m128i low = _mm_set1_epi8(0x0F);
      const __m512i eight = _mm512_set1_epi32(8);
      // [even features' 16 bf16 | odd features' 16] -> feature order
      const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                             22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          for (int64_t g = 0; g < groups; ++g) {
            const __m512 scale = _mm512_set1_ps(sp[r * groups + g]), zero = _mm512_set1_ps(zp[r * groups + g]);
            const uint8_t* bytes = q + r * (k / 2) + g * (group_size / 2);
            T* values = op + r * k + g * group_size;
            for (int64_t j = 0; j < group_size / 2; j += 16) {
              const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + j));
              auto dequantized = [&](__m128i nibbles) {  // (q - 8) * scale, rounded, then + zero
                const __m512 codes = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(nibbles), eight));
                return _mm512_add_ps(_mm512_mul_ps(codes, scale), zero);
              };
              const __m512 even = dequantized(_mm_and_si128(v, low));
              const __m512 odd = dequantized(_mm_and_si128(_mm_srli_epi16(v, 4), low));
              const __m512i pair = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));  // nearest even
              _mm512_storeu_si512(values + 2 * j, _mm512_permutexvar_epi16(order, pair));
            }
          }
      });
      return;
    }
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {  // a group's scale and zero, then its bytes (two features each)
        const float scale = sp[r * groups + g], zero = zp[r * groups + g];
        const uint8_t* bytes = q + r * (k / 2) + g * (group_size / 2);
        T* values = op + r * k + g * group_size;
        for (int64_t j = 0; j < group_size / 2; ++j) {
          values[2 * j] = from_float<T>(static_cast<float>((bytes[j] & 0x0F) - 8) * scale + zero);
          values[2 * j + 1] = from_float<T>(static_cast<float>((bytes[j] >> 4) - 8) * scale + zero);
        }
      }
  });
}

// kernels/widened_linear.py's scratch block: fp32 elements of widened weight per GEMM call.
constexpr int64_t kWidenedElements = 2 * 1024 * 1024;

// `at::linear`, or where torch's GEMM has no native path for x's half-precision dtype (a CPU
// without AVX-512 BF16 / AMX for bf16: 2.5-7x the fp32 GEMM's time there) the fp32 GEMM over the
// weight widened a block of output features at a time, rounded once: kernels/widened_linear.py's
// op, the same calls in the same order, so the two implementations agree bit for bit.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int widened = g_widened_dtypes.load(std::memory_order_relaxed);
  const bool widen = (x.scalar_type() == at::kBFloat16 && (widened & 1)) || (x.scalar_type() == at::kHalf && (widened & 2));
  if (!widen) return at::linear(x, weight, bias);
  const int64_t out_features = weight.size(0), in_features = weight.size(1);
  const at::Tensor rows = x.reshape({-1, in_features}).to(at::kFloat);
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat);
  const int64_t block = std::max<int64_t>(1, kWidenedElements / std::max<int64_t>(1, in_features));
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  if (block >= out_features) return at::linear(rows, weight.to(at::kFloat), bias32).to(x.scalar_type()).view(sizes);
  at::Tensor out = at::empty({rows.size(0), out_features}, x.options());
  for (int64_t start = 0; start < out_features; start += block) {
    const int64_t count = std::min(block, out_features - start);
    std::optional<at::Tensor> part_bias;
    if (bias32.has_value()) part_bias = bias32->narrow(0, start, count);
    out.narrow(1, start, count).copy_(at::linear(rows, weight.narrow(0, start, count).to(at::kFloat), part_bias));
  }
  return out.view(sizes);
}

// x @ dequantized(weight)^T (+ bias) through torch's GEMM, the weight dequantized into a buffer
// kept per thread (a prompt's linears reuse it instead of faulting in a fresh one each call).
at::Tensor dequantized_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                              const at::Tensor* zeros, int64_t group_size, int64_t out_features, int64_t in_features,
                              const std::optional<at::Tensor>& bias) {
  thread_local at::Tensor scratch;
  const int64_t numel = out_features * in_features;
  if (!scratch.defined() || scratch.scalar_type() != x.scalar_type() || scratch.numel() < numel) {
    scratch = at::Tensor();  // the old buffer goes first
    scratch = at::empty({numel}, x.options());
  }
  at::Tensor weight = scratch.narrow(0, 0, numel).view({out_features, in_features});
  switch (x.scalar_type()) {
    case at::kFloat: dequantize_rows<float>(qweight, scales, zeros, group_size, weight); break;
    case at::kBFloat16: dequantize_rows<c10::BFloat16>(qweight, scales, zeros, group_size, weight); break;
    default: dequantize_rows<c10::Half>(qweight, scales, zeros, group_size, weight); break;
  }
  return dense_linear(x, weight, bias);
}

template <bool kManyRows>
at::Tensor int8_linear_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias, const at::Tensor& out) {
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.scalar_type() == at::kChar,
                    "cpu_gemv_int8 takes an int8 [N, K] weight, got ", qweight.scalar_type(), " ", qweight.sizes());
  const int64_t out_features = qweight.size(0), in_features = qweight.size(1);
  TORCH_CHECK_VALUE(scales.numel() == out_features, "cpu_gemv_int8: ", scales.numel(), " scales for ",
                    out_features, " outputs");
  const bool dequantize = kManyRows && x.numel() / std::max<int64_t>(in_features, 1) >= kDequantizeRows;
  QuantizedCall call = quantized_call(x, in_features, out_features, bias, !dequantize, out);
  if (dequantize) return dequantized_linear(x, qweight, scales, nullptr, 0, out_features, in_features, call.bias);
  const std::array<int64_t, 3> version{version_of(qweight), version_of(scales), 0};
  const std::vector<at::Tensor> packed = packed_copy(g_quantized_mutex, g_quantized, qweight, version,
                                                     [&] { return pack_int8(qweight, scales); });
  const auto kernel = kManyRows ? ce_cpu_gemm_int8 : ce_cpu_gemv_int8;
  const int rc = kernel(call.rows.data_ptr(), in_features, call.rows.size(0), packed[0].data_ptr(),
                        packed[1].data_ptr<float>(), call.bias.has_value() ? call.bias->data_ptr() : nullptr,
                        call.out.data_ptr(), in_features, out_features, call.dtype, quantized_path(x, kManyRows),
                        at::get_num_threads());
  TORCH_CHECK(rc == 0, "cpu_gemv_int8: the kernel rejected its arguments (code ", rc, ")");
  return call.out;
}

template <bool kManyRows>
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  return int8_linear_into<kManyRows>(x, qweight, scales, bias, at::Tensor());
}

template <bool kManyRows>
at::Tensor int4_linear_into(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias,
                            const at::Tensor& out) {
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.scalar_type() == at::kByte,
                    "cpu_gemv_int4 takes a uint8 [N, K / 2] weight, got ", qweight.scalar_type(), " ",
                    qweight.sizes());
  const int64_t out_features = qweight.size(0), in_features = 2 * qweight.size(1);
  TORCH_CHECK_VALUE(group_size > 0 && in_features % group_size == 0, "cpu_gemv_int4: group size ", group_size,
                    " does not divide ", in_features, " input features");
  const std::vector<int64_t> groups{out_features, in_features / group_size};
  TORCH_CHECK_VALUE(scales.sizes() == c10::IntArrayRef(groups) && zeros.sizes() == c10::IntArrayRef(groups),
                    "cpu_gemv_int4: scales and zeros must be ", c10::IntArrayRef(groups), ", got ", scales.sizes(),
                    " and ", zeros.sizes());
  // The AVX2 path with int8 x (bf16 / fp16, groups a multiple of 32) keeps the kernel at any row
  // count: it beats dequantizing there too (cpu_gemv_quantized.py's _int8_x_path).
  const bool int8_x = kManyRows && quantized_path(x, true) == kAvx2Path && x.scalar_type() != at::kFloat &&
                      group_size % kInt8XInputs == 0;
  const bool dequantize =
      kManyRows && !int8_x && x.numel() / std::max<int64_t>(in_features, 1) >= kDequantizeRows;
  QuantizedCall call = quantized_call(x, in_features, out_features, bias, !dequantize, out);
  if (dequantize) {
    return dequantized_linear(x, qweight, scales, &zeros, group_size, out_features, in_features, call.bias);
  }
  const std::array<int64_t, 3> version{version_of(qweight), version_of(scales), version_of(zeros)};
  const std::vector<at::Tensor> packed = packed_copy(g_quantized_mutex, g_quantized, qweight, version,
                                                     [&] { return pack_int4(qweight, scales, zeros); });
  const auto kernel = kManyRows ? ce_cpu_gemm_int4 : ce_cpu_gemv_int4;
  const int rc = kernel(call.rows.data_ptr(), in_features, call.rows.size(0), packed[0].data_ptr(),
                        packed[1].data_ptr<float>(), packed[2].data_ptr<float>(), group_size,
                        call.bias.has_value() ? call.bias->data_ptr() : nullptr, call.out.data_ptr(), in_features,
                        out_features, call.dtype, quantized_path(x, kManyRows), at::get_num_threads(),
                        packed.size() > 3 ? static_cast<const uint32_t*>(packed[3].data_ptr()) : nullptr);
  TORCH_CHECK(rc == 0, "cpu_gemv_int4: the kernel rejected its arguments (code ", rc, ")");
  return call.out;
}

template <bool kManyRows>
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& zeros, int64_t group_size, const std::optional<at::Tensor>& bias) {
  return int4_linear_into<kManyRows>(x, qweight, scales, zeros, group_size, bias, at::Tensor());
}

// ---- paged_attention_cpu ----------------------------------------------------------------------

constexpr int64_t kScaleBytes = 4;  // a quantized row's float32 scale (kernels/kv_quant.py)

int kv_kind(at::ScalarType type) {  // the cache's kind as the kernel takes it
  if (type == at::kChar) return 1;
  if (type == at::kFloat8_e4m3fn) return 2;
  return 0;
}

int64_t scale_offset(int64_t head_dim) { return (head_dim + kScaleBytes - 1) / kScaleBytes * kScaleBytes; }

bool is_integer(at::ScalarType type) { return at::isIntegralType(type, /*includeBool=*/false); }

// kernels/reference.py's _check_inputs: shapes and index dtypes only (no values read).
void check_inputs(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                  const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& query_start_loc) {
  TORCH_CHECK_VALUE(query.dim() == 3, "query must be [T, Hq, D], got shape ", query.sizes());
  TORCH_CHECK_VALUE(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
                    "kv_cache must be [2, num_blocks, block_size, Hkv, D], got shape ", kv_cache.sizes());
  const int64_t num_tokens = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv_cache.size(3);
  const std::array<int64_t, 3> kv_shape{num_tokens, num_kv_heads, head_dim};
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"key", key}, {"value", value}}) {
    TORCH_CHECK_VALUE(t.sizes() == c10::IntArrayRef(kv_shape), name, " must be [T, Hkv, D] = ",
                      c10::IntArrayRef(kv_shape), " to match query and kv_cache, got ", t.sizes());
  }
  const bool quantized = kv_kind(kv_cache.scalar_type()) != 0;
  const int64_t width = quantized ? scale_offset(head_dim) + kScaleBytes : head_dim;
  if (quantized) {
    TORCH_CHECK_VALUE(kv_cache.size(4) == width, "a ", kv_cache.scalar_type(), " kv_cache holds packed rows of ",
                      width, " bytes for head dim ", head_dim,
                      " (codes, padding, float32 scale: kernels/kv_quant.py), got ", kv_cache.size(4));
  } else {
    TORCH_CHECK_VALUE(kv_cache.size(4) == width, "kv_cache head dim ", kv_cache.size(4), " != query head dim ",
                      head_dim);
  }
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0, "query heads (", num_q_heads,
                    ") must be a multiple of kv heads (", num_kv_heads, ")");
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens, "slot_mapping must be [T] = [",
                    num_tokens, "], got ", slot_mapping.sizes());
  TORCH_CHECK_VALUE(block_tables.dim() == 2, "block_tables must be [S, max_blocks], got shape ",
                    block_tables.sizes());
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK_VALUE(seq_lens.dim() == 1 && seq_lens.size(0) == num_seqs, "seq_lens must be [S] = [", num_seqs,
                    "], got ", seq_lens.sizes());
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) == num_seqs + 1,
                    "query_start_loc must be [S+1] = [", num_seqs + 1, "], got ", query_start_loc.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"slot_mapping", slot_mapping},
                                {"block_tables", block_tables},
                                {"seq_lens", seq_lens},
                                {"query_start_loc", query_start_loc}}) {
    TORCH_CHECK_VALUE(is_integer(t.scalar_type()), name, " must be an integer tensor, got ", t.scalar_type());
  }
}

at::Tensor as_index(const at::Tensor& t) {  // int32 or int64 with a unit last stride
  const bool wide_enough = t.scalar_type() == at::kInt || t.scalar_type() == at::kLong;
  at::Tensor index = wide_enough ? t : t.to(at::kInt);
  return index.stride(-1) == 1 ? index : index.contiguous();
}

at::Tensor as_rows(const at::Tensor& t, at::ScalarType dtype) {  // [T, H, D], unit stride on D
  at::Tensor rows = t.scalar_type() == dtype ? t : t.to(dtype);
  return rows.stride(-1) == 1 ? rows : rows.contiguous();
}

int64_t address(const at::Tensor& t) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())); }

at::Tensor paged_attention_cpu_into(const at::Tensor& query_in, const at::Tensor& key_in,
                                    const at::Tensor& value_in, const at::Tensor& kv_cache,
                                    const at::Tensor& slot_mapping_in, const at::Tensor& block_tables_in,
                                    const at::Tensor& seq_lens_in, const at::Tensor& query_start_loc_in,
                                    double scale, int64_t sliding_window, double softcap, const at::Tensor& out_in) {
  check_inputs(query_in, key_in, value_in, kv_cache, slot_mapping_in, block_tables_in, seq_lens_in,
               query_start_loc_in);
  const at::ScalarType dtype = query_in.scalar_type();
  const int kind = kv_kind(kv_cache.scalar_type());
  TORCH_CHECK_VALUE(dtype_code(dtype) >= 0 && (kind != 0 || kv_cache.scalar_type() == dtype),
                    "paged_attention_cpu needs query and kv_cache of one dtype out of float32, bfloat16 and "
                    "float16 (or a quantized int8 / float8_e4m3fn cache), got ",
                    dtype, " and ", kv_cache.scalar_type());
  TORCH_CHECK_VALUE(block_tables_in.size(0) > 0,
                    "paged_attention_cpu needs at least one sequence (block_tables is [0, W])");
  TORCH_CHECK_VALUE(kv_cache.stride(-1) == 1, "paged_attention_cpu needs kv_cache's last dimension contiguous");
  const at::Tensor query = as_rows(query_in, dtype), key = as_rows(key_in, dtype), value = as_rows(value_in, dtype);
  const at::Tensor slot_mapping = as_index(slot_mapping_in), block_tables = as_index(block_tables_in);
  const at::Tensor seq_lens = as_index(seq_lens_in), query_start_loc = as_index(query_start_loc_in);
  const int64_t num_tokens = query.size(0), num_q_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  const at::Tensor out = output_of(query.sizes(), query, out_in, "paged_attention_cpu's output");
  const int64_t cache = address(kv_cache);
  // The order kernels/cpu_attention.cpp's ce_cpu_paged_attention documents.
  const std::array<int64_t, 37> ints{
      address(query), query.stride(0), query.stride(1),
      address(key), key.stride(0), key.stride(1),
      address(value), value.stride(0), value.stride(1),
      cache, cache + kv_cache.stride(0) * static_cast<int64_t>(kv_cache.element_size()),
      kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
      address(slot_mapping), slot_mapping.scalar_type() == at::kLong,
      address(block_tables), block_tables.stride(0), block_tables.scalar_type() == at::kLong,
      address(seq_lens), seq_lens.scalar_type() == at::kLong,
      address(query_start_loc), query_start_loc.scalar_type() == at::kLong,
      address(out),
      num_tokens, block_tables.size(0), block_tables.size(1), num_blocks,
      block_size, num_q_heads, num_kv_heads, head_dim,
      sliding_window, dtype_code(dtype), at::get_num_threads(),
      kind, scale_offset(head_dim)};  // clang-format: keep the rows as the .cpp lists them
  const int rc = ce_cpu_paged_attention(ints.data(), static_cast<float>(scale), static_cast<float>(softcap));
  TORCH_CHECK_INDEX(rc != 3, "slot_mapping holds a slot past the cache's ", num_blocks * block_size, " slots");
  TORCH_CHECK(rc == 0, "paged_attention_cpu: the kernel rejected its arguments (code ", rc, ")");
  return out;
}

at::Tensor paged_attention_cpu(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                               at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc, double scale,
                               int64_t sliding_window, double softcap) {
  return paged_attention_cpu_into(query, key, value, kv_cache, slot_mapping, block_tables, seq_lens,
                                  query_start_loc, scale, sliding_window, softcap, at::Tensor());
}

// ---- CpuStepPlan: a compiled decode graph's calls, replayed without Python ----------------------

// graphs/cpu_step_plan.py records the Python wrapper of one Inductor-compiled bucket (its fused C++
// kernels and these ops, called on fixed buffers) and hands each call to a plan; `run` then makes
// the same calls from here, one Python call a step instead of ~10 per layer (the wrapper cost
// 0.3-1.8 ms a decode step on 2 cores: docs/performance.md).

// A fused kernel of Inductor's takes pointers and int64 sizes only (the recorder checks this), passed
// in integer registers / stack slots alike on x86-64 and AArch64, so one int64 signature per
// argument count calls any of them.
using KernelCaller = void (*)(void*, const int64_t*);

template <size_t... I>
void call_kernel(void* fn, const int64_t* args, std::index_sequence<I...>) {
  using Fn = void (*)(decltype(static_cast<void>(I), int64_t{})...);
  reinterpret_cast<Fn>(fn)(args[I]...);
}

template <size_t N>
void call_kernel_with(void* fn, const int64_t* args) {
  call_kernel(fn, args, std::make_index_sequence<N>{});
}

template <size_t... N>
constexpr std::array<KernelCaller, sizeof...(N)> kernel_callers(std::index_sequence<N...>) {
  return {&call_kernel_with<N>...};
}

constexpr size_t kMaxKernelArgs = 96;
constexpr auto kKernelCallers = kernel_callers(std::make_index_sequence<kMaxKernelArgs + 1>{});

struct CpuStepPlan : torch::CustomClassHolder {
  struct Call {
    KernelCaller caller = nullptr;  // a fused kernel: caller(fn, args)
    void* fn = nullptr;
    std::vector<int64_t> args;
    std::function<at::Tensor()> op;  // else one of the ops above, writing into `out`
    at::Tensor out;
  };
  std::vector<Call> calls;

  void add_kernel(int64_t fn, std::vector<int64_t> args) {
    TORCH_CHECK_VALUE(fn != 0, "CpuStepPlan.add_kernel: a null kernel");
    TORCH_CHECK_VALUE(args.size() <= kMaxKernelArgs, "CpuStepPlan.add_kernel: ", args.size(),
                      " arguments, at most ", kMaxKernelArgs);
    Call call;
    call.caller = kKernelCallers[args.size()];
    call.fn = reinterpret_cast<void*>(static_cast<intptr_t>(fn));
    call.args = std::move(args);
    calls.push_back(std::move(call));
  }

  // Op `name` on `tensors` (its tensor arguments in schema order, an absent bias left out), its
  // float and int arguments, writing into `out`. False for an op the plan does not know.
  bool add_op(const std::string& name, std::vector<at::Tensor> t, std::vector<double> floats,
              std::vector<int64_t> ints, at::Tensor out) {
    const size_t n = t.size();
    auto optional_at = [&](size_t i) { return i < n ? std::optional<at::Tensor>(t[i]) : std::nullopt; };
    std::function<at::Tensor()> op;
    if (name == "cpu_gemv" && (n == 2 || n == 3)) {
      op = [t, bias = optional_at(2), out] { return cpu_gemv_into(t[0], t[1], bias, out); };
    } else if (name == "onednn_linear" && (n == 2 || n == 3)) {  // oneDNN allocates: copied into `out`
      op = [t, bias = optional_at(2)] { return onednn_linear(t[0], t[1], bias); };
    } else if ((name == "cpu_gemv_int8" || name == "cpu_gemm_int8") && (n == 3 || n == 4)) {
      const bool many = name == "cpu_gemm_int8";
      op = [t, bias = optional_at(3), out, many] {
        return many ? int8_linear_into<true>(t[0], t[1], t[2], bias, out)
                    : int8_linear_into<false>(t[0], t[1], t[2], bias, out);
      };
    } else if ((name == "cpu_gemv_int4" || name == "cpu_gemm_int4") && (n == 4 || n == 5) && ints.size() == 1) {
      const bool many = name == "cpu_gemm_int4";
      op = [t, bias = optional_at(4), out, many, group = ints[0]] {
        return many ? int4_linear_into<true>(t[0], t[1], t[2], t[3], group, bias, out)
                    : int4_linear_into<false>(t[0], t[1], t[2], t[3], group, bias, out);
      };
    } else if ((name == "mm" || name == "bmm") && n == 2) {  // Inductor's extern GEMMs, into `out`
      const bool batched = name == "bmm";
      op = [t, out, batched]() mutable { return batched ? at::bmm_out(out, t[0], t[1]) : at::mm_out(out, t[0], t[1]); };
    } else if (name == "addmm" && n == 3 && floats.size() == 2) {
      op = [t, out, beta = floats[0], alpha = floats[1]]() mutable {
        return at::addmm_out(out, t[0], t[1], t[2], beta, alpha);
      };
    } else if (name == "paged_attention_cpu" && n == 8 && floats.size() == 2 && ints.size() == 1) {
      op = [t, out, scale = floats[0], softcap = floats[1], window = ints[0]] {
        return paged_attention_cpu_into(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], scale, window, softcap,
                                        out);
      };
    } else {
      return false;
    }
    Call call;
    call.op = std::move(op);
    call.out = std::move(out);
    calls.push_back(std::move(call));
    return true;
  }

  static void make(const Call& call) {
    if (call.caller != nullptr) {
      call.caller(call.fn, call.args.data());
    } else {
      const at::Tensor result = call.op();
      // oneDNN's linear, and past kDequantizeRows the quantized ops, return a new tensor.
      if (result.data_ptr() != call.out.data_ptr()) call.out.copy_(result);
    }
  }

  void run() {
    if (!timed) {
      for (const Call& call : calls) make(call);
      return;
    }
    call_ns.resize(calls.size(), 0);
    for (size_t i = 0; i < calls.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      make(calls[i]);
      call_ns[i] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start)
                        .count();
    }
    ++timed_runs;
  }

  // Multi-step runs (worker/model_runner.py `_run_on`): `steps` more decode steps of the `rows`
  // rows of the step this plan just replayed, each fed the tokens the one before picked, with no
  // Python between them: the tokens, positions, sequence lengths and slots move on in the step's
  // own buffers (the plan's inputs), the plan runs, and `greedy` (kernels/cpu_sampler.cpp's
  // ce_cpu_greedy, passed by address) picks each row's argmax of `logits` (the plan's output).
  // With `draw` (ce_cpu_temperature_draw's address; 0: every row greedy) the rows whose `greedy`
  // flag is false take a draw from softmax(logits / temperature) at this step's row of `uniform`
  // ([steps, rows], drawn by the caller in the order single steps draw them) instead, as the
  // sampler's C++ draw does for a step. `tokens` is int64 [steps + 1, rows], its first row the
  // tokens of the step just run; the rest is filled here. The caller allocated every row's
  // blocks for the whole run.
  void decode_on(int64_t greedy, int64_t draw, at::Tensor greedy_rows, at::Tensor temperature, at::Tensor uniform,
                 at::Tensor tokens, at::Tensor input_ids, at::Tensor positions, at::Tensor seq_lens,
                 at::Tensor slot_mapping, at::Tensor block_tables, int64_t block_size, at::Tensor logits) {
    using Greedy = int (*)(const void*, int64_t, int64_t, int64_t, int, int, int, int64_t*);
    using Draw = int (*)(const void*, int64_t, int64_t, int64_t, int, const float*, const float*, int, int, int64_t*);
    TORCH_CHECK_VALUE(greedy != 0, "CpuStepPlan.decode_on: a null greedy kernel");
    TORCH_CHECK_VALUE(tokens.dim() == 2 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
                      "CpuStepPlan.decode_on: tokens must be a contiguous int64 [steps + 1, rows]");
    const int64_t rows = tokens.size(1), steps = tokens.size(0) - 1;
    if (draw != 0) {
      TORCH_CHECK_VALUE(greedy_rows.dim() == 1 && greedy_rows.size(0) == rows && greedy_rows.scalar_type() == at::kBool &&
                            greedy_rows.is_contiguous(),
                        "CpuStepPlan.decode_on: greedy_rows must be a contiguous bool [", rows, "], got ",
                        greedy_rows.scalar_type(), " ", greedy_rows.sizes());
      TORCH_CHECK_VALUE(temperature.dim() == 1 && temperature.size(0) == rows &&
                            temperature.scalar_type() == at::kFloat && temperature.is_contiguous(),
                        "CpuStepPlan.decode_on: temperature must be a contiguous float32 [", rows, "], got ",
                        temperature.scalar_type(), " ", temperature.sizes());
      TORCH_CHECK_VALUE(uniform.dim() == 2 && uniform.size(0) == steps && uniform.size(1) == rows &&
                            uniform.scalar_type() == at::kFloat && uniform.is_contiguous(),
                        "CpuStepPlan.decode_on: uniform must be a contiguous float32 [", steps, ", ", rows, "], got ",
                        uniform.scalar_type(), " ", uniform.sizes());
    }
    const auto rows_of = [&](const at::Tensor& t, at::ScalarType type, const char* name) {
      TORCH_CHECK_VALUE(t.scalar_type() == type && t.size(-1) == rows && t.stride(-1) == 1, "CpuStepPlan.decode_on: ",
                        name, " must be ", type, " with ", rows, " contiguous columns, got ", t.scalar_type(), " ",
                        t.sizes());
    };
    rows_of(input_ids, at::kLong, "input_ids");
    rows_of(positions, at::kLong, "positions");
    rows_of(seq_lens, at::kInt, "seq_lens");
    rows_of(slot_mapping, at::kLong, "slot_mapping");
    TORCH_CHECK_VALUE(block_tables.dim() == 2 && block_tables.size(0) == rows &&
                          block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 && block_size > 0,
                      "CpuStepPlan.decode_on: block_tables must be int32 [rows, width], got ",
                      block_tables.scalar_type(), " ", block_tables.sizes());
    const int code = dtype_code(logits.scalar_type());
    TORCH_CHECK_VALUE(logits.dim() == 2 && logits.size(0) >= rows && logits.stride(1) == 1 && code >= 0,
                      "CpuStepPlan.decode_on: logits must be float [>= rows, vocab] with contiguous rows");
    int64_t* ids = input_ids.data_ptr<int64_t>();
    int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t pos_rows = positions.dim() == 2 ? positions.size(0) : 1, pos_stride = positions.stride(0);
    int32_t* lens = seq_lens.data_ptr<int32_t>();
    int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int32_t* table = block_tables.data_ptr<int32_t>();
    const int64_t width = block_tables.size(1), table_stride = block_tables.stride(0);
    int64_t* out = tokens.data_ptr<int64_t>();
    const auto pick = reinterpret_cast<Greedy>(static_cast<intptr_t>(greedy));
    std::vector<int64_t> drawn(draw != 0 ? rows : 0);
    const bool* is_greedy = draw != 0 ? greedy_rows.data_ptr<bool>() : nullptr;
    for (int64_t step = 1; step <= steps; ++step) {
      const int64_t* fed = out + (step - 1) * rows;
      for (int64_t r = 0; r < rows; ++r) {
        ids[r] = fed[r];
        for (int64_t p = 0; p < pos_rows; ++p) ++pos[p * pos_stride + r];
        ++lens[r];
        const int64_t at = pos[r], column = at / block_size;
        TORCH_CHECK_INDEX(column < width, "CpuStepPlan.decode_on: row ", r, " reaches position ", at,
                          " past its ", width, " blocks");
        slots[r] = static_cast<int64_t>(table[r * table_stride + column]) * block_size + at % block_size;
      }
      run();
      int64_t* picked = out + step * rows;
      const int rc = pick(logits.data_ptr(), rows, logits.size(1), logits.stride(0), code, 1, at::get_num_threads(),
                          picked);
      TORCH_CHECK(rc == 0, "CpuStepPlan.decode_on: the greedy kernel rejected its arguments (code ", rc, ")");
      if (draw != 0) {
        const int drawn_rc = reinterpret_cast<Draw>(static_cast<intptr_t>(draw))(
            logits.data_ptr(), rows, logits.size(1), logits.stride(0), code, temperature.data_ptr<float>(),
            uniform.data_ptr<float>() + (step - 1) * rows, 1, at::get_num_threads(), drawn.data());
        TORCH_CHECK(drawn_rc == 0, "CpuStepPlan.decode_on: the draw kernel rejected its arguments (code ", drawn_rc,
                    ")");
        for (int64_t r = 0; r < rows; ++r)
          if (!is_greedy[r]) picked[r] = drawn[r];
      }
    }
  }

  // Each call's own time, for a profile of where a replay's time goes (bench/step_profile.py): a
  // plan's kernels run from here, where torch.profiler sees none of them. Off unless asked for,
  // so a replay is the plain loop above.
  bool timed = false;
  int64_t timed_runs = 0;
  std::vector<int64_t> call_ns;  // per call, nanoseconds summed over the timed runs

  void set_timed(bool on) {
    timed = on;
    take_times();
  }

  // The timed runs so far, then each call's nanoseconds summed over them; both start again at 0.
  std::vector<int64_t> take_times() {
    call_ns.resize(calls.size(), 0);
    std::vector<int64_t> times{timed_runs};
    times.insert(times.end(), call_ns.begin(), call_ns.end());
    timed_runs = 0;
    std::fill(call_ns.begin(), call_ns.end(), 0);
    return times;
  }

  int64_t size() const { return static_cast<int64_t>(calls.size()); }
};

}  // namespace

extern "C" {

// Called once after loading (kernels/cpu_ops.py): the paths this CPU runs, the GEMV's and the
// quantized kernels' (a few rows; many rows of bf16 x), and the half-precision dtypes whose GEMMs
// the dequantize-once path widens.
void ce_cpu_ops_configure(int gemv_isa, int quantized_gemv_path, int quantized_bf16_many_rows_path,
                          int widened_dtypes) {
  g_widened_dtypes.store(widened_dtypes, std::memory_order_relaxed);
  g_isa.store(gemv_isa, std::memory_order_relaxed);
  g_quantized_gemv_path.store(quantized_gemv_path, std::memory_order_relaxed);
  g_quantized_bf16_many_rows_path.store(quantized_bf16_many_rows_path, std::memory_order_relaxed);
}

// How many packed copies of live weights are held (tests: a dead weight's copy goes): the
// GEMV's (which = 0), oneDNN's (1) or the quantized kernels' (2).
int64_t ce_cpu_ops_packed_copies(int which) {
  if (which == 0) return live_copies(g_packed_mutex, g_packed);
  if (which == 1) return live_copies(g_onednn_mutex, g_onednn_packed);
  return live_copies(g_quantized_mutex, g_quantized);
}

}  // extern "C"

TORCH_LIBRARY_IMPL(compiled_engine, CPU, m) {
  m.impl("cpu_gemv", &cpu_gemv);
  m.impl("paged_attention_cpu", &paged_attention_cpu);
  m.impl("onednn_linear", &onednn_linear);
  m.impl("cpu_gemv_int8", &int8_linear<false>);
  m.impl("cpu_gemm_int8", &int8_linear<true>);
  m.impl("cpu_gemv_int4", &int4_linear<false>);
  m.impl("cpu_gemm_int4", &int4_linear<true>);
}

TORCH_LIBRARY_FRAGMENT(compiled_engine, m) {
  m.class_<CpuStepPlan>("CpuStepPlan")
      .def(torch::init<>())
      .def("add_kernel", &CpuStepPlan::add_kernel)
      .def("add_op", &CpuStepPlan::add_op)
      .def("run", &CpuStepPlan::run)
      .def("size", &CpuStepPlan::size)
      .def("decode_on", &CpuStepPlan::decode_on)
      .def("set_timed", &CpuStepPlan::set_timed)
      .def("take_times", &CpuStepPlan::take_times);
}
