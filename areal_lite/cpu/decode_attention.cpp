// Decode attention of the embedded engine on CPU: one query token per cache row against that
// row's cached keys and values, all (row, KV head) pairs in one call.
//
// Built at run time by decode_attention.py for one (dtype, head dim, query heads per KV head),
// given as the macros BF16, HD and GROUP, so that the loops over them unroll and the
// accumulators stay in vector registers. Vectors are GCC's generic vectors as wide as the
// registers of the instruction set it is built for (16 floats with AVX-512, 8 with AVX2).
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

// The vector width in floats and the vector registers of the instruction set the kernel is built
// for: AVX-512 has 32 registers of 16 floats, AVX2 16 of 8. Every loop below keeps its
// accumulators and the vectors it loads within the registers (GCC's generic vectors wider than
// the registers, as 16 floats on AVX2, spilled to memory there: 4-17x slower).
#ifdef __AVX512F__
constexpr int W = 16, REGS = 32;
#else
constexpr int W = 8, REGS = 16;
#endif

typedef float fv __attribute__((vector_size(4 * W)));
typedef uint32_t uv32 __attribute__((vector_size(4 * W)));
typedef uint16_t hv __attribute__((vector_size(2 * W)));

#if BF16
typedef uint16_t T;
static inline float to_float(T x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
static inline T from_float(float f) {
  // Round to nearest even, as torch's float -> bfloat16 conversion (values here are finite).
  uint32_t u = std::bit_cast<uint32_t>(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<T>(u >> 16);
}
static inline fv load(const T* p) {
  hv h;
  std::memcpy(&h, p, sizeof(h));
  uv32 w = __builtin_convertvector(h, uv32) << 16;
  return std::bit_cast<fv>(w);
}
#else
typedef float T;
static inline float to_float(T x) { return x; }
static inline T from_float(float f) { return f; }
static inline fv load(const T* p) {
  fv v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
#endif

static_assert(HD % 16 == 0, "the head dimension is a multiple of 16");
constexpr int BLOCK = 16;        // positions per block of the key cache
constexpr int VPB = BLOCK / W;   // vectors per block
constexpr int HV = HD / W;       // vectors per head-dimension row

// Blocks of scores per step: GROUP x NB x VPB accumulators and NB x VPB loaded keys in registers
// (2 spare for the broadcast query value), at most 4 blocks.
constexpr int NB = std::clamp((REGS - 2) / (VPB * (GROUP + 1)), 1, 4);

// Head-dimension vectors of the value sum per pass over the positions: GROUP x CH accumulators and
// CH loaded values in registers; a divisor of HV.
constexpr int ch_of(int limit) {
  int c = std::clamp(limit, 1, HV);
  while (HV % c) c--;
  return c;
}
constexpr int CH = ch_of((REGS - 2) / (GROUP + 1));

// Scores of the B blocks of 16 positions starting at l0 for every query head of the group.
template <int B>
static inline void score_block(const float (&qf)[GROUP][HD], const T* K, int64_t l0, float* scores, int64_t width) {
  fv acc[GROUP][B][VPB] = {};
  const T* block = K + l0 * HD;  // l0 / 16 blocks of HD x 16
  for (int d = 0; d < HD; d++) {
    fv kv[B][VPB];
    for (int b = 0; b < B; b++)
      for (int u = 0; u < VPB; u++) kv[b][u] = load(block + (b * HD + d) * BLOCK + u * W);
    for (int g = 0; g < GROUP; g++)
      for (int b = 0; b < B; b++)
        for (int u = 0; u < VPB; u++) acc[g][b][u] += qf[g][d] * kv[b][u];
  }
  for (int g = 0; g < GROUP; g++)
    for (int b = 0; b < B; b++)
      for (int u = 0; u < VPB; u++)
        std::memcpy(scores + g * width + l0 + BLOCK * b + W * u, &acc[g][b][u], sizeof(fv));
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
        K[(last / BLOCK * HD + d) * BLOCK + last % BLOCK] = kn[i * HD + d];
        V[last * HD + d] = vn[i * HD + d];
      }
      const T* Q = q + i * GROUP * HD;
      float qf[GROUP][HD];
      for (int g = 0; g < GROUP; g++)
        for (int d = 0; d < HD; d++) qf[g][d] = to_float(Q[g * HD + d]) * scale;

      // Scores: NB blocks at a time, then one; the last block's positions past n are
      // computed (the cache holds finite values there) and never read.
      int64_t l = 0;
      for (; l + NB * BLOCK <= n; l += NB * BLOCK) score_block<NB>(qf, K, l, scores, width);
      for (; l < n; l += BLOCK) score_block<1>(qf, K, l, scores, width);

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

      // Probabilities times values, CH head-dimension vectors at a time.
      T* O = out + i * GROUP * HD;
      for (int c0 = 0; c0 < HV; c0 += CH) {
        fv o[GROUP][CH] = {};
        for (int64_t j = 0; j < n; j++) {
          fv vv[CH];
          for (int c = 0; c < CH; c++) vv[c] = load(V + j * HD + W * (c0 + c));
          for (int g = 0; g < GROUP; g++) {
            const float p = scores[g * width + j];
            for (int c = 0; c < CH; c++) o[g][c] += p * vv[c];
          }
        }
        for (int g = 0; g < GROUP; g++)
          for (int c = 0; c < CH; c++)
            for (int e = 0; e < W; e++) O[g * HD + W * (c0 + c) + e] = from_float(o[g][c][e] * inv[g]);
      }
    }
    std::free(scores);
  }
}
