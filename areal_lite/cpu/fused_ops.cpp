// The small per-token operations of the embedded engine's decoder layers on CPU, each one pass
// over its rows instead of several torch ops: the residual add with the RMS norm after it, the
// rotary embedding with the split of the fused q/k/v projection, and SiLU times the up projection.
//
// Built at run time by fused_ops.py for one dtype (the macro BF16). Each result is rounded to the
// storage dtype where HF's eager modules round it (bf16: after the add, after the normalization,
// after the weight; after each rotary product and their sum; after SiLU and after the product),
// so that the engine computes what an HF forward in that dtype computes; the arithmetic between
// roundings is float32, as torch's CPU kernels do it.
//
// Rows are split over `threads` OpenMP threads where there are enough of them.

#include <algorithm>
#include <cmath>
#include <cstdint>

#if BF16
typedef uint16_t T;
static inline float to_float(T x) {
  union {
    uint32_t u;
    float f;
  } c = {static_cast<uint32_t>(x) << 16};
  return c.f;
}
static inline T from_float(float f) {
  // Round to nearest even, as torch's float -> bfloat16 conversion; a NaN stays a NaN (tested on
  // the bits: -ffast-math drops std::isnan).
  union {
    float f;
    uint32_t u;
  } c = {f};
  if ((c.u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<T>((c.u >> 16) | 0x40u);
  c.u += 0x7FFFu + ((c.u >> 16) & 1u);
  return static_cast<T>(c.u >> 16);
}
#else
typedef float T;
static inline float to_float(T x) { return x; }
static inline T from_float(float f) { return f; }
#endif
static inline float rnd(float f) { return to_float(from_float(f)); }

// Rows per thread below which a call runs on one thread (the threads' start costs more).
constexpr int64_t MIN_ROWS = 4;

// h[i] += d[i] (when d is not null), then x[i] = w * normalized(h[i]): HF's LlamaRMSNorm (and
// Qwen2's, Mistral's...): the variance in float32, the normalized row rounded, times the weight.
extern "C" void add_rms_norm(T* h, const T* d, const T* w, T* x, int64_t n, int64_t width, float eps,
                             int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && n >= MIN_ROWS * threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    T* hr = h + i * width;
    T* xr = x + i * width;
    float sq = 0.0f;
    if (d != nullptr) {
      const T* dr = d + i * width;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < width; j++) {
        const float v = rnd(to_float(hr[j]) + to_float(dr[j]));
        hr[j] = from_float(v);
        sq += v * v;
      }
    } else {
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < width; j++) {
        const float v = to_float(hr[j]);
        sq += v * v;
      }
    }
    const float inv = 1.0f / std::sqrt(sq / static_cast<float>(width) + eps);
#pragma omp simd
    for (int64_t j = 0; j < width; j++) xr[j] = from_float(to_float(w[j]) * rnd(to_float(hr[j]) * inv));
  }
}

// out[i] = silu(gu[i, :inter]) * gu[i, inter:], gu's rows `stride` elements apart.
extern "C" void silu_mul(const T* gu, T* out, int64_t n, int64_t inter, int64_t stride, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && n >= MIN_ROWS * threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const T* g = gu + i * stride;
    const T* u = g + inter;
    T* o = out + i * inter;
#pragma omp simd
    for (int64_t j = 0; j < inter; j++) {
      const float x = to_float(g[j]);
      o[j] = from_float(rnd(x / (1.0f + std::exp(-x))) * to_float(u[j]));
    }
  }
}

// The fused projection's rows qkv[i] = [q heads | k heads | v heads] x hd (rows `stride` elements
// apart) into contiguous q [n, nq, hd], k [n, nkv, hd] and v [n, nkv, hd], the queries and keys
// rotated by the angles of position pos[i]: x cos + rotate_half(x) sin, with cos and sin the
// rows [positions, hd] of the model's tables.
extern "C" void rope_split(const T* qkv, const T* cos, const T* sin, const int64_t* pos, T* q, T* k, T* v, int64_t n,
                           int64_t nq, int64_t nkv, int64_t hd, int64_t stride, int threads) {
  const int64_t half = hd / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && n >= MIN_ROWS * threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const T* src = qkv + i * stride;
    const T* c = cos + pos[i] * hd;
    const T* s = sin + pos[i] * hd;
    for (int64_t head = 0; head < nq + nkv; head++) {
      const T* x = src + head * hd;
      T* y = head < nq ? q + (i * nq + head) * hd : k + (i * nkv + head - nq) * hd;
#pragma omp simd
      for (int64_t j = 0; j < half; j++) {
        const float x1 = to_float(x[j]), x2 = to_float(x[j + half]);
        y[j] = from_float(rnd(x1 * to_float(c[j])) - rnd(x2 * to_float(s[j])));
        y[j + half] = from_float(rnd(x2 * to_float(c[j + half])) + rnd(x1 * to_float(s[j + half])));
      }
    }
    const T* vs = src + (nq + nkv) * hd;
    T* vd = v + i * nkv * hd;
#pragma omp simd
    for (int64_t j = 0; j < nkv * hd; j++) vd[j] = vs[j];
  }
}

// ---- Training (float32): forward and backward of the RMS norm and of SiLU times up, for the
// trainer's autograd functions (fused_ops.py). Same formulas as HF's modules in float32.

// y = w * x * rstd, rstd[i] = 1 / sqrt(mean(x[i]^2) + eps) kept for the backward.
extern "C" void rms_norm_forward(const float* x, const float* w, float* y, float* rstd, int64_t n, int64_t width,
                                 float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && n >= MIN_ROWS * threads) schedule(static)
  for (int64_t i = 0; i < n; i++) {
    const float* xr = x + i * width;
    float* yr = y + i * width;
    float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
    for (int64_t j = 0; j < width; j++) sq += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(sq / static_cast<float>(width) + eps);
    rstd[i] = r;
#pragma omp simd
    for (int64_t j = 0; j < width; j++) yr[j] = w[j] * (xr[j] * r);
  }
}

// With xh = x * rstd and g = w * dy: dx = rstd * (g - xh * mean(g * xh)); dw = sum over rows of
// dy * xh (each thread sums its rows, then the threads' sums are added).
extern "C" void rms_norm_backward(const float* x, const float* w, const float* rstd, const float* dy, float* dx,
                                  float* dw, int64_t n, int64_t width, int threads) {
  for (int64_t j = 0; j < width; j++) dw[j] = 0.0f;
#pragma omp parallel num_threads(threads) if (threads > 1 && n >= MIN_ROWS * threads)
  {
    float* part = new float[width]();
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; i++) {
      const float* xr = x + i * width;
      const float* gr = dy + i * width;
      float* dr = dx + i * width;
      const float r = rstd[i];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < width; j++) {
        const float xh = xr[j] * r;
        dot += w[j] * gr[j] * xh;
        part[j] += gr[j] * xh;
      }
      const float mean = dot / static_cast<float>(width);
#pragma omp simd
      for (int64_t j = 0; j < width; j++) dr[j] = r * (w[j] * gr[j] - xr[j] * r * mean);
    }
#pragma omp critical
    for (int64_t j = 0; j < width; j++) dw[j] += part[j];
    delete[] part;
  }
}

// Elements per chunk of the elementwise loops below: a chunk is one thread's work item and one
// vectorized inner loop (GCC vectorizes `parallel for simd` over the whole range poorly: 5x slower).
constexpr int64_t CHUNK = 4096;

// out = silu(g) * u over `count` elements.
extern "C" void silu_mul_forward(const float* g, const float* u, float* out, int64_t count, int threads) {
  const int64_t chunks = (count + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) if (threads > 1 && chunks >= 16) schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t end = std::min(count, (c + 1) * CHUNK);
#pragma omp simd
    for (int64_t j = c * CHUNK; j < end; j++) out[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  }
}

// With s = sigmoid(g): du = dout * g * s, dg = dout * u * s * (1 + g * (1 - s)).
extern "C" void silu_mul_backward(const float* g, const float* u, const float* dout, float* dg, float* du, int64_t count,
                                  int threads) {
  const int64_t chunks = (count + CHUNK - 1) / CHUNK;
#pragma omp parallel for num_threads(threads) if (threads > 1 && chunks >= 16) schedule(static)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t end = std::min(count, (c + 1) * CHUNK);
#pragma omp simd
    for (int64_t j = c * CHUNK; j < end; j++) {
      const float s = 1.0f / (1.0f + std::exp(-g[j]));
      du[j] = dout[j] * g[j] * s;
      dg[j] = dout[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
    }
  }
}
