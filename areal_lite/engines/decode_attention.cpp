// Decode attention of the embedded engine on CPU: one query token per cache row against that
// row's cached keys and values, all (row, KV head) pairs in one call.
//
// Built at run time by decode_attention.py for one (dtype, head dim, query heads per KV head),
// given as the macros BF16, HD and GROUP, so that the loops over them unroll and the
// accumulators stay in vector registers. Vectors are GCC's generic vectors of 16 floats, which
// the compiler maps onto the CPU's widest registers (one AVX-512 register, two AVX2 ones).
//
// Each row's new key and value are written into the cache at its last position (lens - 1)
// first, by the thread that then reads them.
//
// Layout (the model runner's cache):
//   q    [rows, kv heads, GROUP, HD]        contiguous
//   kn   [rows, kv heads, HD]               contiguous: the new keys; vn the same for values
//   k    [rows, kv heads, capacity / 16, HD, 16]
//                                           keys in blocks of 16 positions, transposed within a
//                                           block: scores are vector FMAs over 16 positions at a
//                                           time (no horizontal sum per position), and a block is
//                                           2 or 4 KiB read in order
//   v    [rows, kv heads, capacity, HD]
//   out  [rows, kv heads, GROUP, HD]        contiguous
//   lens [rows]                             positions each row attends to (0 .. lens-1)
// Scores, softmax and the weighted sum of values are in float32 whatever the storage dtype.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

typedef float f16v __attribute__((vector_size(64)));
typedef uint32_t u16v32 __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));

#if BF16
typedef uint16_t T;
static inline float to_float(T x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
static inline T from_float(float f) {
  // Round to nearest even, as torch's float -> bfloat16 conversion (values here are finite).
  uint32_t u = std::bit_cast<uint32_t>(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<T>(u >> 16);
}
static inline f16v load16(const T* p) {
  h16v h;
  std::memcpy(&h, p, sizeof(h));
  u16v32 w = __builtin_convertvector(h, u16v32) << 16;
  return std::bit_cast<f16v>(w);
}
#else
typedef float T;
static inline float to_float(T x) { return x; }
static inline T from_float(float f) { return f; }
static inline f16v load16(const T* p) {
  f16v v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
#endif

static_assert(HD % 16 == 0, "the head dimension is a multiple of 16");
constexpr int HV = HD / 16;  // vectors per head-dimension row

// Scores of the NB blocks of 16 positions starting at l0 for every query head of the group.
template <int NB>
static inline void score_block(const float (&qf)[GROUP][HD], const T* K, int64_t l0, float* scores, int64_t width) {
  f16v acc[GROUP][NB] = {};
  const T* block = K + l0 * HD;  // l0 / 16 blocks of HD x 16
  for (int d = 0; d < HD; d++) {
    f16v kv[NB];
    for (int b = 0; b < NB; b++) kv[b] = load16(block + (b * HD + d) * 16);
    for (int g = 0; g < GROUP; g++)
      for (int b = 0; b < NB; b++) acc[g][b] += qf[g][d] * kv[b];
  }
  for (int g = 0; g < GROUP; g++)
    for (int b = 0; b < NB; b++) std::memcpy(scores + g * width + l0 + 16 * b, &acc[g][b], sizeof(f16v));
}

extern "C" void decode_attention(const T* q, const T* kn, const T* vn, T* k, T* v, T* out, const int64_t* lens,
                                 int64_t rows,
                                 int64_t nkv, int64_t k_row, int64_t k_head, int64_t v_row,
                                 int64_t v_head, float scale, int64_t max_len, int threads) {
  const int64_t width = (max_len + 63) / 64 * 64;
#pragma omp parallel num_threads(threads)
  {
    float* scores = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * GROUP * width));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < rows * nkv; i++) {
      const int64_t r = i / nkv, h = i % nkv;
      const int64_t n = lens[r];
      T* K = k + r * k_row + h * k_head;
      T* V = v + r * v_row + h * v_head;
      const int64_t last = n - 1;
      for (int d = 0; d < HD; d++) {
        K[(last / 16 * HD + d) * 16 + last % 16] = kn[i * HD + d];
        V[last * HD + d] = vn[i * HD + d];
      }
      const T* Q = q + i * GROUP * HD;
      float qf[GROUP][HD];
      for (int g = 0; g < GROUP; g++)
        for (int d = 0; d < HD; d++) qf[g][d] = to_float(Q[g * HD + d]) * scale;

      // Scores: four blocks at a time, then one; the last block's positions past n are
      // computed (the cache holds finite values there) and never read.
      int64_t l = 0;
      for (; l + 64 <= n; l += 64) score_block<4>(qf, K, l, scores, width);
      for (; l < n; l += 16) score_block<1>(qf, K, l, scores, width);

      // Softmax per query head (n >= 1: a row attends at least to its own position).
      float inv[GROUP];
      for (int g = 0; g < GROUP; g++) {
        float* s = scores + g * width;
        float top = s[0];
        for (int64_t j = 1; j < n; j++) top = std::max(top, s[j]);
        float sum = 0.0f;
        for (int64_t j = 0; j < n; j++) {
          s[j] = std::exp(s[j] - top);
          sum += s[j];
        }
        inv[g] = 1.0f / sum;
      }

      // Probabilities times values: GROUP x HV vector accumulators.
      f16v o[GROUP][HV] = {};
      for (int64_t j = 0; j < n; j++) {
        f16v vv[HV];
        for (int c = 0; c < HV; c++) vv[c] = load16(V + j * HD + 16 * c);
        for (int g = 0; g < GROUP; g++) {
          const float p = scores[g * width + j];
          for (int c = 0; c < HV; c++) o[g][c] += p * vv[c];
        }
      }
      T* O = out + i * GROUP * HD;
      for (int g = 0; g < GROUP; g++)
        for (int c = 0; c < HV; c++)
          for (int e = 0; e < 16; e++) O[g * HD + 16 * c + e] = from_float(o[g][c][e] * inv[g]);
    }
    std::free(scores);
  }
}
