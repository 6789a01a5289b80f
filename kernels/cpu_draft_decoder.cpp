// A small Llama-family draft model's proposal loop in one call: feed a sequence's last tokens,
// then make k one-token steps, each choosing its proposal (speculative decoding's draft_model).
//
// Built at run time by kernels/cpu_attention_build.py (g++ -O3 -march=native -fopenmp) and called
// through ctypes by kernels/cpu_draft_decoder.py, which documents the contract and owns the
// weights and KV buffers this reads and writes.
//
// Why: a draft pays only when k of its steps cost a small part of one target step. The draft
// for the embedded model has under a million parameters, so a step is a few hundred thousand
// multiply-adds: as a compiled torch graph its time went to launching ~100 small kernels per
// call, gathering the slot's whole KV row and attending over every position of it. Here a step
// is plain loops on a team of threads in one parallel region: each thread multiplies the same
// blocks of the weight matrices every step, so its part (bfloat16 when the draft runs in it:
// 0.9 MB of that draft's 1.8 MB on each of two cores) stays in its core's cache across the k
// steps, and attention reads only the positions written. Arithmetic is float32 throughout;
// bfloat16 weights are widened exactly.
//
// The maths is the model's own (transformers' Llama, Qwen2, Qwen3): RMS norm, q/k/v projections
// (Qwen2's biases, Qwen3's per-head q/k norms), rotary embedding by the cos/sin tables passed in
// (rotate-half convention), causal grouped-query attention over the slot's positions, SiLU-gated
// MLP, final norm, LM head. Each proposal is the logits' argmax (temperature 0) or, sampled, the
// exponential race argmax(q / noise) with q = softmax(logits / temperature) and noise ~ Exp(1):
// a draw from q. q is returned for the verifier's min(1, p / q) rule when asked for.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Matrices (qkv, o, gate_up, down, embed, lm_head) are in the model's weight dtype, all but embed
// packed for `gemv` below; norms, biases, rotary tables and caches are float32. Optional pointers
// are null when the model has none. Shapes are the unpacked ones.
struct Layer {
  const float* input_norm;  // [hidden]
  const void* qkv;          // [(heads + 2 kv heads) * head_dim, hidden]: q, k, v rows stacked
  const float* qkv_bias;    // [(heads + 2 kv heads) * head_dim] or null
  const float* q_norm;      // [head_dim] or null
  const float* k_norm;      // [head_dim] or null
  const void* o;            // [hidden, heads * head_dim]
  const float* post_norm;   // [hidden]
  const void* gate_up;      // [2 * ffn, hidden]: gate rows, then up rows
  const void* down;         // [hidden, ffn]
};

}  // namespace

extern "C" {

// Mirrored by a ctypes.Structure in kernels/cpu_draft_decoder.py: keep the two in step.
struct CeDraftModel {
  int64_t hidden, num_heads, num_kv_heads, head_dim, ffn, vocab, num_layers, max_len, num_slots;
  float eps;
  int64_t weight_dtype;     // 0: float32, 1: bfloat16
  const void* embed;        // [vocab, hidden], not packed: rows are looked up
  const float* final_norm;  // [hidden]
  const void* lm_head;      // [vocab, hidden]
  const float* cos;         // [max_len, head_dim]
  const float* sin;         // [max_len, head_dim]
  float* k_cache;           // [layers, slots, max_len, kv heads, head_dim]
  float* v_cache;
  const Layer* layers;      // [num_layers]
};

}  // extern "C"

namespace {

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bfloat16 bits to float32: exact
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// 16 float32 lanes (GCC vector extensions: one AVX-512 register, two AVX2 ones, or loops).
typedef float F16 __attribute__((vector_size(64)));
typedef uint32_t U32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));

// exp(x) for x <= 0 in 16 lanes: std::exp does not vectorise without -ffast-math, and the
// attention's softmax and the MLP's SiLU ran it once per score and per unit, on one thread while
// the other waited at the next barrier. x = n ln2 + f (n = floor(x / ln2 + 1/2), ln2 split in two
// for precision), e^f by its degree-6 Taylor polynomial (|f| <= ln2 / 2: relative error ~1e-7),
// 2^n built in the exponent bits; 0 below -87, -inf included.
inline F16 exp_nonpositive(F16 x) {
  F16 y = x * 1.44269504088896341f + 0.5f;
  y = y < -127.f ? F16{} - 127.f : y;  // the exponent's floor; also keeps -inf out of the int cast
  const I32x16 t = __builtin_convertvector(y, I32x16);  // toward zero
  const I32x16 n = t + (__builtin_convertvector(t, F16) > y);  // floor: one less where it rounded up
  const F16 nf = __builtin_convertvector(n, F16);
  const F16 f = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;
  F16 p = F16{} + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const U32x16 bits = __builtin_convertvector(n + 127, U32x16) << 23;
  F16 scale;
  std::memcpy(&scale, &bits, 64);
  const F16 e = p * scale;
  return x < -87.f ? F16{} : e;
}

// s[j] = exp(s[j] - top) for j < n (every s[j] <= top); returns their sum.
float exp_shifted(float* s, int64_t n, float top) {
  F16 sum = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    F16 v;
    std::memcpy(&v, s + j, 64);
    v = exp_nonpositive(v - top);
    std::memcpy(s + j, &v, 64);
    sum += v;
  }
  if (j < n) {  // the tail through a padded register: lanes past n hold -inf, so exp gives 0
    F16 v = F16{} - INFINITY;
    std::memcpy(&v, s + j, (n - j) * sizeof(float));
    v = exp_nonpositive(v - top);
    std::memcpy(s + j, &v, (n - j) * sizeof(float));
    sum += v;
  }
  float total = 0.f;
  for (int i = 0; i < 16; ++i) total += sum[i];
  return total;
}

// gate[i] = silu(gate[i]) * up[i] for i < n, silu(g) = g * sigmoid(g), sigmoid(g) from
// e = exp(-|g|): 1 / (1 + e) for g >= 0, e / (1 + e) below.
void silu_mul(float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t m = n - i < 16 ? n - i : 16;
    F16 g = {}, u = {};
    std::memcpy(&g, gate + i, m * sizeof(float));
    std::memcpy(&u, up + i, m * sizeof(float));
    const F16 e = exp_nonpositive(g < 0.f ? g : -g);
    const F16 sigmoid = (g < 0.f ? e : F16{} + 1.f) / (1.f + e);
    const F16 out = g * sigmoid * u;
    std::memcpy(gate + i, &out, m * sizeof(float));
  }
}

// The 64 weights of one input for a block of 64 outputs, as four vectors of outputs 0-15, 16-31,
// 32-47, 48-63. float32: stored in that order. bfloat16: each 32-bit word holds the pair
// (output j, output j + 16) of a 32-output half (`pack_matrix`), so a shift and a mask widen a
// whole 64-byte load into two vectors with no lane shuffles: a plain bfloat16-to-float32
// conversion (vpmovzxwd) runs on the one shuffle port, and that limited this loop.
inline void load_block(const float* p, F16& a, F16& b, F16& c, F16& d) {
  std::memcpy(&a, p, 64);
  std::memcpy(&b, p + 16, 64);
  std::memcpy(&c, p + 32, 64);
  std::memcpy(&d, p + 48, 64);
}
inline void widen_pairs(const uint16_t* p, F16& low, F16& high) {
  U32x16 words;
  std::memcpy(&words, p, 64);
  const U32x16 first = words << 16, second = words & 0xffff0000u;
  std::memcpy(&low, &first, 64);
  std::memcpy(&high, &second, 64);
}
inline void load_block(const uint16_t* p, F16& a, F16& b, F16& c, F16& d) {
  widen_pairs(p, a, b);
  widen_pairs(p + 32, c, d);
}

// y[o] = W[o, :] . x (+ b[o]) for o < rows, W packed as [rows / 64 rounded up][cols][64]
// (kernels/cpu_draft_decoder.py `pack_matrix`: 64 outputs side by side per input, zeros past
// `rows`), so each input's 64 weights multiply one broadcast x value with no horizontal sums;
// two inputs at a time into eight independent accumulators, to keep the FMAs' latency hidden.
// Called by every thread of the team: the blocks are shared out the same way every call, so each
// core keeps re-reading its own part of the weights from its own cache; the loop ends in a barrier.
template <typename W>
void gemv(const void* weight, const float* x, const float* b, float* y, int64_t rows, int64_t cols) {
  const W* w = static_cast<const W*>(weight);
  const int64_t blocks = (rows + 63) / 64;
#pragma omp for schedule(static)
  for (int64_t block = 0; block < blocks; ++block) {
    const W* p = w + block * cols * 64;
    F16 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
    F16 w0, w1, w2, w3;
    int64_t i = 0;
    for (; i + 1 < cols; i += 2, p += 128) {
      const float xi = x[i], xj = x[i + 1];
      load_block(p, w0, w1, w2, w3);
      a0 += w0 * xi;
      a1 += w1 * xi;
      a2 += w2 * xi;
      a3 += w3 * xi;
      load_block(p + 64, w0, w1, w2, w3);
      b0 += w0 * xj;
      b1 += w1 * xj;
      b2 += w2 * xj;
      b3 += w3 * xj;
    }
    if (i < cols) {  // an odd input count's last input
      load_block(p, w0, w1, w2, w3);
      a0 += w0 * x[i];
      a1 += w1 * x[i];
      a2 += w2 * x[i];
      a3 += w3 * x[i];
    }
    a0 += b0;
    a1 += b1;
    a2 += b2;
    a3 += b3;
    float out[64];
    std::memcpy(out, &a0, 64);
    std::memcpy(out + 16, &a1, 64);
    std::memcpy(out + 32, &a2, 64);
    std::memcpy(out + 48, &a3, 64);
    const int64_t n = rows - block * 64 < 64 ? rows - block * 64 : 64;
    for (int64_t j = 0; j < n; ++j) y[block * 64 + j] = b ? out[j] + b[block * 64 + j] : out[j];
  }
}

// out = x / rms(x) * weight (float32 throughout, as the reference does for float32 weights).
void rms_norm(const float* x, const float* weight, float* out, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

// In place: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]).
void rope(float* x, const float* cos, const float* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

struct Scratch {  // shared by the team
  std::vector<float> x, h, qkv, attn, gate_up, scores;
  explicit Scratch(const CeDraftModel& m)
      : x(m.hidden),
        h(m.hidden),
        qkv((m.num_heads + 2 * m.num_kv_heads) * m.head_dim),
        attn(m.num_heads * m.head_dim),
        gate_up(2 * m.ffn),
        scores(m.num_heads * m.max_len) {}
};

// Sum of a vector's 16 lanes: halves added four times (a scalar chain of 16 adds was most of
// a score's cost).
inline float lane_sum(F16 v) {
  typedef int32_t Mask __attribute__((vector_size(64)));
  v += __builtin_shuffle(v, Mask{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, Mask{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, Mask{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, Mask{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
  return v[0];
}

// attend() for a head dim of kChunks x 16: the query and the output's accumulators in vector
// registers. (With the output in memory each position's update waited on the previous one's
// store: that chain was most of the attention's time.)
template <int kChunks>
void attend_vectors(const float* qh, const float* keys, const float* values, float* scores, float* o,
                    int64_t stride, float scale, int64_t position) {
  F16 qv[kChunks], acc[kChunks];
  for (int c = 0; c < kChunks; ++c) {
    std::memcpy(&qv[c], qh + 16 * c, 64);
    acc[c] = F16{};
  }
  float top = -INFINITY;
  for (int64_t j = 0; j <= position; ++j) {
    const float* kj = keys + j * stride;
    F16 dot = {};
    for (int c = 0; c < kChunks; ++c) {
      F16 k;
      std::memcpy(&k, kj + 16 * c, 64);
      dot += qv[c] * k;
    }
    scores[j] = lane_sum(dot) * scale;
    top = scores[j] > top ? scores[j] : top;
  }
  const float inverse = 1.f / exp_shifted(scores, position + 1, top);
  for (int64_t j = 0; j <= position; ++j) {
    const float* vj = values + j * stride;
    const float p = scores[j] * inverse;
    for (int c = 0; c < kChunks; ++c) {
      F16 v;
      std::memcpy(&v, vj + 16 * c, 64);
      acc[c] += v * p;
    }
  }
  for (int c = 0; c < kChunks; ++c) std::memcpy(o + 16 * c, &acc[c], 64);
}

// Causal attention of query head `hq` over positions 0..position of the slot's keys and values
// ([position][kv head][head_dim]); it reads kv head hq / group. `scores`: room for position + 1.
void attend(const float* q, const float* keys, const float* values, float* scores, float* out, int64_t hq,
            int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t position) {
  const int64_t D = head_dim, hk = hq / group;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* qh = q + hq * D;
  float* o = out + hq * D;
  keys += hk * D;
  values += hk * D;
  const int64_t stride = num_kv_heads * D;
  switch (D) {
    case 64: return attend_vectors<4>(qh, keys, values, scores, o, stride, scale, position);
    case 128: return attend_vectors<8>(qh, keys, values, scores, o, stride, scale, position);
    default: break;
  }
  float top = -INFINITY;
  for (int64_t j = 0; j <= position; ++j) {
    const float* kj = keys + j * stride;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < D; ++d) dot += qh[d] * kj[d];
    scores[j] = dot * scale;
    top = scores[j] > top ? scores[j] : top;
  }
  const float total = exp_shifted(scores, position + 1, top);
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  for (int64_t j = 0; j <= position; ++j) {
    const float* vj = values + j * stride;
    const float p = scores[j] / total;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += p * vj[d];
  }
}

// One token at `position` of `slot` through the model: writes its k/v into the caches and, when
// `logits` is not null, the next-token logits [vocab]. W: the weight matrices' element type.
// Called by every thread of the team: the matrices' blocks and the query heads are shared out
// (`omp for`), the small vector steps run on one thread (`omp single`); both end in a barrier.
template <typename W>
void forward_token(const CeDraftModel& m, Scratch& s, int64_t slot, int64_t token, int64_t position,
                   float* logits) {
  const int64_t H = m.hidden, D = m.head_dim, NH = m.num_heads, NKV = m.num_kv_heads;
  const float* cos = m.cos + position * D;
  const float* sin = m.sin + position * D;
  float* x = s.x.data();
  float* h = s.h.data();
  float* qkv = s.qkv.data();
  float* gate = s.gate_up.data();
  const int64_t slot_stride = m.max_len * NKV * D;  // one slot's positions, per layer
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const Layer& layer = m.layers[l];
#pragma omp single
    {
      if (l == 0) {
        const W* row = static_cast<const W*>(m.embed) + token * H;
        for (int64_t i = 0; i < H; ++i) x[i] = widen(row[i]);
      }
      rms_norm(x, layer.input_norm, h, H, m.eps);
    }
    gemv<W>(layer.qkv, h, layer.qkv_bias, qkv, (NH + 2 * NKV) * D, H);
    float* q = qkv;
    float* k = qkv + NH * D;
    float* v = k + NKV * D;
    const int64_t base = (l * m.num_slots + slot) * slot_stride;
    float* keys = m.k_cache + base;
    float* values = m.v_cache + base;
#pragma omp single
    {
      for (int64_t head = 0; head < NH; ++head) {
        if (layer.q_norm) rms_norm(q + head * D, layer.q_norm, q + head * D, D, m.eps);
        rope(q + head * D, cos, sin, D);
      }
      for (int64_t head = 0; head < NKV; ++head) {
        if (layer.k_norm) rms_norm(k + head * D, layer.k_norm, k + head * D, D, m.eps);
        rope(k + head * D, cos, sin, D);
      }
      for (int64_t i = 0; i < NKV * D; ++i) {
        keys[position * NKV * D + i] = k[i];
        values[position * NKV * D + i] = v[i];
      }
    }
#pragma omp for schedule(static)
    for (int64_t hq = 0; hq < NH; ++hq)
      attend(q, keys, values, s.scores.data() + hq * m.max_len, s.attn.data(), hq, NH / NKV, NKV, D,
             position);
    gemv<W>(layer.o, s.attn.data(), nullptr, h, H, NH * D);
#pragma omp single
    {
      for (int64_t i = 0; i < H; ++i) x[i] += h[i];
      rms_norm(x, layer.post_norm, h, H, m.eps);
    }
    gemv<W>(layer.gate_up, h, nullptr, gate, 2 * m.ffn, H);
#pragma omp single
    {
      const float* up = gate + m.ffn;
      silu_mul(gate, up, m.ffn);
    }
    gemv<W>(layer.down, gate, nullptr, h, H, m.ffn);
#pragma omp single
    for (int64_t i = 0; i < H; ++i) x[i] += h[i];
  }
  if (logits == nullptr) return;
#pragma omp single
  rms_norm(x, m.final_norm, h, H, m.eps);
  gemv<W>(m.lm_head, h, nullptr, logits, m.vocab, H);
}

// softmax(logits / temperature) into q (temperature 1 when not sampling).
void softmax(const float* logits, float* q, int64_t n, float temperature) {
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) top = logits[i] > top ? logits[i] : top;
  float total = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    q[i] = std::exp((logits[i] - top) / temperature);
    total += q[i];
  }
  const float inverse = 1.f / total;
  for (int64_t i = 0; i < n; ++i) q[i] *= inverse;
}

int64_t argmax(const float* values, int64_t n) {  // the first of equal maxima, as torch's
  // The maximum in vector lanes, then its first position: a compare-and-branch per element ran
  // on one thread while the other waited.
  float top = values[0];
#pragma omp simd reduction(max : top)
  for (int64_t i = 1; i < n; ++i) top = values[i] > top ? values[i] : top;
  for (int64_t i = 0; i < n; ++i)
    if (values[i] == top) return i;
  return 0;  // NaN only
}

}  // namespace

extern "C" {

// Feed `num_tokens` tokens of `slot` at positions first_position.., then make `num_proposals`
// proposals (each fed in turn but the last) into `proposals`. `temperature` > 0 samples by the
// race against `noise` [num_proposals, vocab] (Exp(1) draws); otherwise proposals are argmaxes.
// `probs` [num_proposals, vocab], when not null, receives each step's q = softmax(logits / T),
// T = 1 for argmax proposals. Runs on a team of `num_threads` threads (OpenMP). Returns 0, or -1
// for arguments out of range (nothing written).
int ce_draft_propose(const CeDraftModel* model, int64_t slot, const int64_t* tokens, int64_t num_tokens,
                     int64_t first_position, int64_t num_proposals, float temperature, const float* noise,
                     int64_t* proposals, float* probs, int num_threads) {
  const CeDraftModel& m = *model;
  if (slot < 0 || slot >= m.num_slots || num_tokens < 1 || num_proposals < 1 || first_position < 0 ||
      first_position + num_tokens + num_proposals - 1 > m.max_len || num_threads < 1)
    return -1;
  for (int64_t i = 0; i < num_tokens; ++i)
    if (tokens[i] < 0 || tokens[i] >= m.vocab) return -1;
  if (temperature > 0.f && noise == nullptr) return -1;
  if (m.weight_dtype != 0 && m.weight_dtype != 1) return -1;
  const auto forward = m.weight_dtype == 1 ? forward_token<uint16_t> : forward_token<float>;
  Scratch scratch(m);
  const int64_t V = m.vocab;
  std::vector<float> logits(V), race(V);
  const bool sampled = temperature > 0.f;
  int64_t token = 0;  // the proposal being fed: written by one thread, read by all after a barrier
#pragma omp parallel num_threads(num_threads)
  {
    for (int64_t i = 0; i < num_tokens; ++i)
      forward(m, scratch, slot, tokens[i], first_position + i, i + 1 == num_tokens ? logits.data() : nullptr);
    for (int64_t step = 0; step < num_proposals; ++step) {
#pragma omp single
      {
        float* q = probs ? probs + step * V : race.data();
        if (sampled) {
          softmax(logits.data(), q, V, temperature);
          const float* e = noise + step * V;
          for (int64_t i = 0; i < V; ++i) race[i] = q[i] / e[i];
          token = argmax(race.data(), V);
        } else {
          if (probs) softmax(logits.data(), q, V, 1.f);
          token = argmax(logits.data(), V);
        }
        proposals[step] = token;
      }
      if (step + 1 < num_proposals)
        forward(m, scratch, slot, token, first_position + num_tokens + step, logits.data());
    }
  }
  return 0;
}

}  // extern "C"
