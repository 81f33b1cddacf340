// The scalar dequantizer of every block format (formats.h): gguf-py's arithmetic, op for op.
#include "formats.h"

namespace tandem {
namespace {

// One block of a 32-wide Q5 or a K-quant, exactly as gguf-py computes it (no FMA: the files are built with
// -ffp-contract=off). A template per format, with every per-sub-block choice hoisted out of the inner loops, so the
// compiler can vectorise them.
template <int64_t FMT>
void dequant_block_t(const uint8_t* blk, float* o) {
  if constexpr (FMT == Q5_0 || FMT == Q5_1) {
    const float d = fp16_to_fp32(blk);
    const float m = FMT == Q5_1 ? fp16_to_fp32(blk + 2) : 0.f;
    const uint8_t* qhp = blk + (FMT == Q5_1 ? 4 : 2);
    const uint32_t qh = load_u32(qhp);
    const uint8_t* qs = qhp + 4;
    for (int i = 0; i < 16; ++i) {
      const int lo = (qs[i] & 0x0f) | (((qh >> i) & 1) << 4);
      const int hi = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      if constexpr (FMT == Q5_0) {
        o[i] = d * static_cast<float>(lo - 16);
        o[i + 16] = d * static_cast<float>(hi - 16);
      } else {
        o[i] = d * static_cast<float>(lo) + m;
        o[i + 16] = d * static_cast<float>(hi) + m;
      }
    }
  } else if constexpr (FMT == Q4_K || FMT == Q5_K) {
    const float d = fp16_to_fp32(blk), dmin = fp16_to_fp32(blk + 2);
    const uint8_t* sc6 = blk + 4;
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (FMT == Q5_K ? 48 : 16);
    for (int j = 0; j < 8; ++j) {
      float sc, mn;
      k_scale_min(sc6, j, sc, mn);
      const float dd = d * sc, dm = dmin * mn;
      const uint8_t* g = qs + (j / 2) * 32;
      const int shift = (j % 2) * 4;
      float* oj = o + j * 32;
      for (int l = 0; l < 32; ++l) {
        int q = (g[l] >> shift) & 0x0f;
        if constexpr (FMT == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
        oj[l] = dd * static_cast<float>(q) - dm;
      }
    }
  } else {  // Q6_K
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = fp16_to_fp32(blk + 208);
    for (int j = 0; j < 8; ++j) {
      const uint8_t* lo_bytes = ql + (j / 4) * 64 + (j % 2) * 32;
      const uint8_t* hi_bytes = qh + (j / 4) * 32;
      const int lo_shift = 4 * ((j / 2) % 2), hi_shift = 2 * (j % 4);
      for (int half = 0; half < 2; ++half) {  // 16 weights share one int8 scale
        const float ds = d * static_cast<float>(sc[j * 2 + half]);
        float* oj = o + j * 32 + half * 16;
        for (int l = 0; l < 16; ++l) {
          const int idx = half * 16 + l;
          const int lo = (lo_bytes[idx] >> lo_shift) & 0x0f;
          const int hi = (hi_bytes[idx] >> hi_shift) & 3;
          oj[l] = ds * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
        }
      }
    }
  }
}

template <int64_t FMT>
void dequant_row_t(const uint8_t* row, int64_t K, float* out) {
  constexpr int64_t bb = block_bytes(FMT), be = block_elems(FMT);
  for (int64_t b = 0; b < K / be; ++b) dequant_block_t<FMT>(row + b * bb, out + b * be);
}

void dequant_row_generic(int64_t fmt, const uint8_t* row, int64_t K, float* out) {
  switch (fmt) {
    case Q5_0: return dequant_row_t<Q5_0>(row, K, out);
    case Q5_1: return dequant_row_t<Q5_1>(row, K, out);
    case Q4_K: return dequant_row_t<Q4_K>(row, K, out);
    case Q5_K: return dequant_row_t<Q5_K>(row, K, out);
    default: return dequant_row_t<Q6_K>(row, K, out);
  }
}

}  // namespace

void dequant_row_scalar(int64_t fmt, const uint8_t* row, float scale, int64_t K, float* out) {
  if (fmt >= Q5_0) return dequant_row_generic(fmt, row, K, out);
  if (fmt == I8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
    for (int64_t k = 0; k < K; ++k) out[k] = scale * static_cast<float>(q[k]);
    return;
  }
  const int64_t bb = block_bytes(fmt);
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* blk = row + b * bb;
    const float d = fp16_to_fp32(blk);
    float* o = out + b * 32;
    if (fmt == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int i = 0; i < 32; ++i) o[i] = static_cast<float>(q[i]) * d;
    } else if (fmt == Q4_1) {
      const float m = fp16_to_fp32(blk + 2);
      const uint8_t* q = blk + 4;
      for (int i = 0; i < 16; ++i) {
        o[i] = d * static_cast<float>(q[i] & 0x0f) + m;
        o[i + 16] = d * static_cast<float>(q[i] >> 4) + m;
      }
    } else {  // Q4_0
      const uint8_t* q = blk + 2;
      for (int i = 0; i < 16; ++i) {
        o[i] = d * static_cast<float>((q[i] & 0x0f) - 8);
        o[i + 16] = d * static_cast<float>((q[i] >> 4) - 8);
      }
    }
  }
}

}  // namespace tandem
