// One fused pass per slice of a parameter for CPUAdamW's compact state formats: decode the
// master and the moments, AdamW, encode them back. The codes, the rounding and the random bits
// are those of compact.py; the AdamW arithmetic is that of the vectorized loop of torch's fused
// CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp), operation for operation in fp32:
//
//     p = p * (1 - lr * wd)
//     m = fma(w, g - m, m)               w = 1 - beta1 < 0.5 (else fma(w - 1, g - m, g))
//     v = fma((1 - beta2) * g, g, v * beta2)
//     p = p + (-lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
//
// torch writes v as v * beta2 + (1 - beta2) * g * g; its builds contract that into the fma above
// (GCC's default), which this file writes out: on torch 2.13's x86 wheel the vector loop's
// results are reproduced bit for bit (tests/test_optim_native.py). Built with -ffp-contract=off,
// so no other multiply-add is fused; the compiler vectorizes the element loops (-O3
// -march=native) and may not reassociate (no -ffast-math), so every element's result is fixed by
// its inputs alone. Where torch runs its scalar tail instead (the last < 16 elements of a tensor
// piece), its rounding of v differs in the last bit now and then.
//
// Plain C ABI, no torch headers: compact_kernel.py builds it with the system compiler in a few
// seconds and calls it through ctypes, which releases the GIL for the call.

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kBlock = 256;  // QUANT_BLOCK: elements per absmax of the 8-bit moments

enum Master { kFp32 = 0, kSplit = 1, kStochastic = 2, kBf16 = 3 };

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// murmur3's 32-bit finalizer of (element index * golden ratio + key): compact.hash_bits.
inline uint32_t hash_bits(uint32_t index, uint32_t key) {
  uint32_t h = index * 0x9E3779B1u + key;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// 8-bit codes (compact.py): decode and encode of one element, y = x / absmax.
inline float decode_m(uint8_t code) {
  uint32_t k = code & 127u;
  uint32_t bits = k ? (k + 889u) << 20 : 0u;  // m's code 0 is 0
  return float_of(bits | (uint32_t(code & 128u) << 24));
}

inline float decode_v(uint8_t code) { return float_of((uint32_t(code) + 761u) << 20); }

inline uint8_t encode_m(float y) {  // signed, to nearest, below 2**-16 flushed to 0
  uint32_t bits = bits_of(y);
  int32_t t = int32_t((bits & 0x7FFFFFFFu) + (1u << 19));
  int32_t k = (t >> 20) - 889;
  return uint8_t((k < 0 ? 0 : k) | int32_t((bits >> 24) & 128u));
}

inline uint8_t encode_v(float y, uint32_t rand) {  // stochastic by rand's high 16 bits, never 0
  uint32_t bits = bits_of(y);
  int32_t t = int32_t((bits & 0x7FFFFFFFu) + ((rand >> 16) << 4));
  int32_t k = (t >> 20) - 761;
  return uint8_t(k < 0 ? 0 : k);
}

// 1 / absmax, a block of zeros (or an absmax whose reciprocal overflows) scaled by 0:
// compact.encode_8bit's reciprocal().nan_to_num_(posinf=0).
inline uint16_t bf16_nearest(float x) {  // to nearest even, as torch casts fp32 to bf16
  uint32_t bits = bits_of(x);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return std::isnan(x) ? uint16_t(0x7FC0) : uint16_t(rounded);
}

inline float inverse(float absmax) {
  float inv = 1.0f / absmax;
  return inv <= 3.4028234663852886e38f ? inv : 0.0f;
}

struct Hyper {  // as torch's kernel rounds them to fp32 (compact_kernel.py computes them)
  float decay;  // 1 - lr * weight_decay
  float lerp;  // 1 - beta1
  float beta2;
  float sq_coeff;  // 1 - beta2
  float bc2_sqrt;  // sqrt(1 - beta2 ** step)
  float eps;
  float neg_step;  // -lr / (1 - beta1 ** step)
  float grad_scale;  // the gradient is divided by it (1: unscaled)
};

struct Slice {  // the arguments of megaslide_adamw_compact, below
  void* p;
  int16_t* lo;
  uint16_t* copy;
  float* m;
  float* v;
  uint8_t* code_m;
  uint8_t* code_v;
  float* absmax_m;
  float* absmax_v;
  const void* g;
  int64_t n;
  int64_t start;
  uint32_t key;
};

// One 256-element block at a time (a tensor's last one may be shorter): the random bits first
// (in a loop of their own: computed inside the others, the hash slowed them by ~15% here), then
// the update loop decodes each element's state, updates it and encodes the master; with 8-bit
// moments it keeps the new m and v in the block's buffers, whose absmax the encoding needs.
template <int kMaster, bool k8bit, typename G, bool kScaled>
void update(const Slice& s, const Hyper& h) {
  void* const p_ = s.p;
  int16_t* const lo = s.lo;
  uint16_t* const copy = s.copy;
  uint8_t *const code_m = s.code_m, *const code_v = s.code_v;
  const G* const g = static_cast<const G*>(s.g);
  const int64_t n = s.n, start = s.start;
  const uint32_t key = s.key;
  const bool small = std::fabs(h.lerp) < 0.5f;
  const float coeff = small ? h.lerp : h.lerp - 1.0f;
  for (int64_t b0 = 0; b0 < n; b0 += kBlock) {
    const int64_t len = n - b0 < kBlock ? n - b0 : kBlock;
    float mb[kBlock], vb[kBlock];
    float* const m = k8bit ? mb : s.m + b0;
    float* const v = k8bit ? vb : s.v + b0;
    const float am = k8bit ? s.absmax_m[b0 / kBlock] : 0.0f;
    const float av = k8bit ? s.absmax_v[b0 / kBlock] : 0.0f;
    uint32_t rand[kBlock];  // low 16 bits round a bf16-sr master, high 16 the 8-bit v
    if constexpr (kMaster == kStochastic || k8bit) {
      for (int64_t j = 0; j < kBlock; ++j) rand[j] = hash_bits(uint32_t(start + b0 + j), key);
    }
    uint32_t top_m = 0, top_v = 0;  // absmax as the largest magnitude's bits: an integer max
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = b0 + j;
      float p;
      if constexpr (kMaster == kFp32) {
        p = static_cast<float*>(p_)[i];
      } else {
        uint32_t hi = static_cast<uint16_t*>(p_)[i];
        uint32_t low = kMaster == kSplit ? uint32_t(int32_t(lo[i])) : 0u;
        p = float_of((hi << 16) + low);
      }
      float grad;
      if constexpr (sizeof(G) == 2) {
        grad = float_of(uint32_t(g[i]) << 16);  // bf16 widened exactly
      } else {
        grad = g[i];
      }
      float mj, vj;
      if constexpr (k8bit) {
        mj = decode_m(code_m[i]) * am;
        vj = decode_v(code_v[i]) * av;
      } else {
        mj = m[j];
        vj = v[j];
      }
      if constexpr (kScaled) grad = grad / h.grad_scale;
      p = p * h.decay;
      mj = std::fma(coeff, grad - mj, small ? mj : grad);
      vj = std::fma(h.sq_coeff * grad, grad, vj * h.beta2);
      m[j] = mj;
      v[j] = vj;
      if constexpr (k8bit) {
        uint32_t a = bits_of(mj) & 0x7FFFFFFFu, b = bits_of(vj) & 0x7FFFFFFFu;
        top_m = a > top_m ? a : top_m;
        top_v = b > top_v ? b : top_v;
      }
      float denom = std::sqrt(vj) / h.bc2_sqrt + h.eps;
      p = p + h.neg_step * mj / denom;
      uint32_t bits = bits_of(p);
      if constexpr (kMaster == kFp32) {
        static_cast<float*>(p_)[i] = p;
      } else if constexpr (kMaster == kSplit) {  // high half to nearest, ties away; low: the rest
        static_cast<uint16_t*>(p_)[i] = uint16_t((bits + 0x8000u) >> 16);
        lo[i] = int16_t(uint16_t(bits));
      } else if constexpr (kMaster == kStochastic) {
        static_cast<uint16_t*>(p_)[i] = uint16_t((bits + (rand[j] & 0xFFFFu)) >> 16);
      } else {
        static_cast<uint16_t*>(p_)[i] = bf16_nearest(p);
      }
    }
    if (kMaster == kFp32 && copy != nullptr) {  // a loop of its own: ~10% faster than inside
      const float* const p32 = static_cast<float*>(p_) + b0;
      for (int64_t j = 0; j < len; ++j) copy[b0 + j] = bf16_nearest(p32[j]);
    }
    if constexpr (k8bit) {
      for (int64_t j = len; j < kBlock; ++j) mb[j] = vb[j] = 0.0f;  // a tensor's padding
      const float new_am = float_of(top_m), new_av = float_of(top_v);
      s.absmax_m[b0 / kBlock] = new_am;
      s.absmax_v[b0 / kBlock] = new_av;
      const float inv_m = inverse(new_am), inv_v = inverse(new_av);
      for (int64_t j = 0; j < kBlock; ++j) {  // v rounded by the high 16 random bits
        code_m[b0 + j] = encode_m(mb[j] * inv_m);
        code_v[b0 + j] = encode_v(vb[j] * inv_v, rand[j]);
      }
    }
  }
}

// Unscaled gradients skip the division (x / 1 is x): ~5% of the time of a step here.
template <int kMaster, bool k8bit, typename G>
void dispatch_scale(const Slice& s, const Hyper& h) {
  if (h.grad_scale != 1.0f) {
    update<kMaster, k8bit, G, true>(s, h);
  } else {
    update<kMaster, k8bit, G, false>(s, h);
  }
}

template <int kMaster, bool k8bit>
void dispatch_grad(bool grad_bf16, const Slice& s, const Hyper& h) {
  if (grad_bf16) {
    dispatch_scale<kMaster, k8bit, uint16_t>(s, h);
  } else {
    dispatch_scale<kMaster, k8bit, float>(s, h);
  }
}

template <int kMaster>
void dispatch_moments(bool eight_bit, bool grad_bf16, const Slice& s, const Hyper& h) {
  if (eight_bit) {
    dispatch_grad<kMaster, true>(grad_bf16, s, h);
  } else {
    dispatch_grad<kMaster, false>(grad_bf16, s, h);
  }
}

}  // namespace

extern "C" {

// One slice: elements start .. start + n - 1 of one tensor (start a multiple of 256). The
// pointers are at the slice's first element: p (fp32, or bf16 bits), lo (bf16-split's low
// halves, else null), copy (an fp32 master's bf16 compute copy to write, or null), m and v
// (fp32 moments, else null), code_m / code_v and absmax_m / absmax_v (8-bit moments: the
// slice's codes padded to a multiple of 256 and one absmax per 256, else null), g (fp32 or
// bf16). hyper: the 8 floats of Hyper. Returns 0, or -1 for a master kind it does not know.
int megaslide_adamw_compact(int master, int eight_bit, int grad_bf16, void* p, int16_t* lo,
                            uint16_t* copy, float* m, float* v, uint8_t* code_m, uint8_t* code_v,
                            float* absmax_m, float* absmax_v, const void* g, int64_t n,
                            int64_t start, uint32_t key, const float* hyper) {
  Hyper h;
  std::memcpy(&h, hyper, sizeof h);
  const Slice s{p, lo, copy, m, v, code_m, code_v, absmax_m, absmax_v, g, n, start, key};
  switch (master) {
    case kFp32:
      dispatch_moments<kFp32>(eight_bit, grad_bf16, s, h);
      return 0;
    case kSplit:
      dispatch_moments<kSplit>(eight_bit, grad_bf16, s, h);
      return 0;
    case kStochastic:
      dispatch_moments<kStochastic>(eight_bit, grad_bf16, s, h);
      return 0;
    case kBf16:
      dispatch_moments<kBf16>(eight_bit, grad_bf16, s, h);
      return 0;
  }
  return -1;
}

// compact.hash_bits(n, start, key) into out: for the tests, which check the bits bitwise.
void megaslide_hash_bits(uint32_t* out, int64_t n, int64_t start, uint32_t key) {
  for (int64_t j = 0; j < n; ++j) out[j] = hash_bits(uint32_t(start + j), key);
}

}  // extern "C"
