/* Decode attention straight from the paged KV pool, on the CPU (slime/backends/hf_engine/cpu_decode.py builds it).
 *
 * Each decoding row has one query per head; row r attends its first keys[r] positions, held in the pool blocks
 * table[r, 0..]. Per (row, KV head), block by block, each of the G query heads sharing that KV head takes the
 * block's scores, an online softmax (running max and sum, rescaled as a block raises the max) and the weighted
 * values, its accumulator held in registers (`attend` is inlined with the head dim a constant for 64 and 128).
 * Nothing is gathered: the torch path copies every row's keys and values into a padded batch first, and that copy
 * moves as many bytes as the attention reads.
 *
 * q:     [b, Hq, D] float32, element (r, h, e) at q[r * q_row + h * q_head + e]
 * kv:    [2, Hkv, NB, bs, D] float32, contiguous (one layer of the pool: keys, then values)
 * table: [b, m] int64, contiguous; keys: [b] int64 (>= 1); out: [b, Hq, D] float32, contiguous
 * Returns 0, or -1 when a size is past the fixed buffers (the caller then takes the torch path).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256

static inline float exp_approx(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float n = floorf(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r
             + 1.6666665459e-1f) * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

/* one (row, KV head): its G query heads over its first n positions */
static inline void attend(const float *q, int64_t q_head, const float *keys_base, const float *vals_base,
                          const int64_t *table, int64_t n, int64_t bs, int64_t g_size, const int64_t d,
                          float scale, float *out) {
  float acc[MAX_GROUP * MAX_HEAD_DIM], mx[MAX_GROUP], sum[MAX_GROUP], s[MAX_GROUP * MAX_BLOCK];
  for (int64_t g = 0; g < g_size; ++g) {
    mx[g] = -INFINITY;
    sum[g] = 0.0f;
    for (int64_t e = 0; e < d; ++e) acc[g * d + e] = 0.0f;
  }
  for (int64_t j = 0; j * bs < n; ++j) {
    const int64_t cnt = n - j * bs < bs ? n - j * bs : bs;
    const float *kb = keys_base + table[j] * bs * d;
    const float *vb = vals_base + table[j] * bs * d;
    for (int64_t g = 0; g < g_size; ++g) {
      const float *qg = q + g * q_head;
      float *sg = s + g * MAX_BLOCK;
      for (int64_t t = 0; t < cnt; ++t) {
        const float *kt = kb + t * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t e = 0; e < d; ++e) dot += qg[e] * kt[e];
        sg[t] = dot * scale;
      }
      float top = mx[g];
      for (int64_t t = 0; t < cnt; ++t) top = sg[t] > top ? sg[t] : top;
      const float rescale = exp_approx(mx[g] - top);
      float part = 0.0f;
#pragma omp simd reduction(+ : part)
      for (int64_t t = 0; t < cnt; ++t) {
        const float p = exp_approx(sg[t] - top);
        sg[t] = p;
        part += p;
      }
      sum[g] = sum[g] * rescale + part;
      mx[g] = top;
      float a[MAX_HEAD_DIM];
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) a[e] = acc[g * d + e] * rescale;
      for (int64_t t = 0; t < cnt; ++t) {
        const float p = sg[t];
        const float *vt = vb + t * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) a[e] += p * vt[e];
      }
#pragma omp simd
      for (int64_t e = 0; e < d; ++e) acc[g * d + e] = a[e];
    }
  }
  for (int64_t g = 0; g < g_size; ++g) {
    const float inv = 1.0f / sum[g];
#pragma omp simd
    for (int64_t e = 0; e < d; ++e) out[g * d + e] = acc[g * d + e] * inv;
  }
}

int paged_decode(const float *q, int64_t q_row, int64_t q_head, const float *kv, const int64_t *table,
                 const int64_t *keys, float *out, int64_t b, int64_t hq, int64_t d, int64_t hkv, int64_t nb,
                 int64_t bs, int64_t m, float scale, int threads) {
  const int64_t g_size = hq / hkv;
  if (g_size > MAX_GROUP || d > MAX_HEAD_DIM || bs > MAX_BLOCK || g_size * hkv != hq) return -1;
  const float *values = kv + hkv * nb * bs * d;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < b * hkv; ++i) {
    const int64_t r = i / hkv, h = i % hkv;
    const float *qr = q + r * q_row + h * g_size * q_head;
    float *o = out + (r * hq + h * g_size) * d;
    const float *kb = kv + h * nb * bs * d, *vb = values + h * nb * bs * d;
    if (d == 64) attend(qr, q_head, kb, vb, table + r * m, keys[r], bs, g_size, 64, scale, o);
    else if (d == 128) attend(qr, q_head, kb, vb, table + r * m, keys[r], bs, g_size, 128, scale, o);
    else attend(qr, q_head, kb, vb, table + r * m, keys[r], bs, g_size, d, scale, o);
  }
  return 0;
}
