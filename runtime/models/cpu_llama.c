/* A whole decode step of a Llama-family model on the CPU, in one call: token ids in,
 * logits out, keys and values written to (and read from) the paged KV cache in place.
 *
 * Why C: a batch-1 decode step reads every weight once, so its floor is memory bandwidth
 * (~18 ms for the built-in model). In torch it takes ~48 ms: matrix-vector products reach
 * 13-18 GB/s, and ~400 small ops a step cost ~20 ms of dispatch. Here the weights are
 * packed in panels of 8 rows ([N/8][K][8], one sequential stream per thread), every phase
 * of a layer runs on all threads with a barrier between phases, and the small ops (norms,
 * RoPE, attention, SwiGLU) are fused into the phases around them.
 *
 * Threads: OpenMP, linked against the libgomp that torch has already loaded (same soname),
 * so a step runs on torch's own intra-op threads. A second pool would fight them for the
 * cores: torch's threads spin for a while after every op, and one descheduled thread
 * stalls every barrier (measured: 33 ms a step instead of 22).
 *
 * The same library serves two ops of the torch (prefill) path: SwiGLU in one pass, and
 * attention of a step's prefill rows read from the paged cache in place (torch's SDPA path
 * gathers every block first and pads sequences to buckets: 2-2.5x slower).
 *
 * Qwen3 differs only by an RMSNorm of each query and key head before RoPE, fused into attention.
 *
 * The reference is the torch model (runtime/models/decoder.py over kernels/reference.py):
 * tests compare logits, cache contents, and each prefill op's output. Shapes and the cache layout are those of
 * kernels/reference.py; the cache is stored [2, kvh, num_blocks, block_size, d].
 * Quantized weights (GGUF's Q4_0, Q4_1, Q8_0 blocks, kept as the file stores them): a batch-1
 * step reads 4.5-8.5 bits a weight instead of 32. Small batches (up to QUANT_DOT_MAX_BATCH)
 * quantize each input row to 8-bit blocks (llama.cpp's Q8 activations) and take integer dot
 * products block by block. Larger batches are compute-bound, where the float tiles do more
 * per instruction: they run on the float panels where the decoder keeps them too, else
 * dequantize 16 rows at a time into a float panel in cache and run the tiles on it (both
 * exact to the dequantized weights). The reference is gguf.quants (tests/models/test_cpu_quantized.py).
 *
 * Compiled at first use (runtime/models/cpu_llama.py) with -O3 -mavx2 -mfma -mf16c.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_BATCH 256
#define MAX_THREADS 64
#define QUANT_DOT_MAX_BATCH 4 /* larger batches run float tiles (see above); measured: 8 lost to them */
#define QK 32                 /* weights per block of Q4_0, Q4_1, Q8_0; per input block (any type) */
#define QK_K 256              /* weights per super-block of the K-quants */
enum { TYPE_F32_PANELS = 0, TYPE_Q4_0 = 2, TYPE_Q4_1 = 3, TYPE_Q8_0 = 8, TYPE_Q4_K = 12, TYPE_Q5_K = 13, TYPE_Q6_K = 14 }; /* ggml's numbers */

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
    int64_t block_size, num_blocks, max_positions;
    double eps, scale;
    const float *embed;      /* [vocab, hidden], row-major */
    const float *final_norm; /* [hidden] */
    const float *lm_head;    /* panels of [vocab padded to 8, hidden] */
    const float *cos_sin;    /* [max_positions, head_dim]: cos half, then sin half */
    /* per layer: */
    const float **input_norm, **post_norm; /* [hidden] */
    const float **qkv, **qkv_bias;         /* panels of [(h + 2 kvh) d, hidden]; bias [(h + 2 kvh) d] or NULL */
    const float **o;                       /* panels of [hidden, h d] */
    const float **gate_up;                 /* panels alternating 8 gate rows, 8 up rows: [2 I, hidden] */
    const float **down;                    /* panels of [hidden, I] */
    float **kv;                            /* [2, kvh, num_blocks, block_size, d] */
    /* quantized weights: per layer qkv, o, gate_up, down (rows in the same order as the panels'
     * rows, each row its K / 32 GGUF blocks), then the LM head; type 0: the float panels above */
    const uint8_t **qkv_q, **o_q, **gate_up_q, **down_q;
    const uint8_t *lm_head_q;
    const int64_t *types; /* [num_layers * 4 + 1]: qkv, o, gate_up, down of each layer, then the LM head */
    const float **q_norm, **k_norm; /* per layer [head_dim]: Qwen3's RMSNorm of each head before RoPE; NULL: none */
    /* mixture-of-experts layers (Mixtral, Qwen2/3-MoE): a layer whose router is not NULL routes each
     * token to top_k of num_experts SwiGLU experts instead of its dense MLP (gate_up, down unused) */
    int64_t num_experts, top_k, moe_intermediate, norm_topk_prob; /* norm_topk_prob: renormalise the top-k weights */
    const float **router;          /* per layer: panels of [num_experts padded to 8, hidden], or NULL */
    const float **expert_gate_up;  /* per layer: each expert's gate_up panels [2 Im, hidden], expert after expert */
    const float **expert_down;     /* per layer: each expert's down panels [hidden, Im], expert after expert */
    /* Qwen2-MoE's shared expert beside the routed ones, scaled by sigmoid(shared_gate . x); NULL: none */
    int64_t shared_intermediate;
    const float **shared_gate_up, **shared_down; /* per layer: panels of [2 Is, hidden], [hidden, Is] */
    const float **shared_gate;                   /* per layer: [hidden] */
} Model;

/* A weight matrix: float panels, rows of GGUF blocks of `type` (0: none), or both. */
typedef struct {
    const float *panels;
    const uint8_t *blocks;
    int64_t type;
} Mat;

typedef struct {
    int64_t batch;                /* sequences, one new token each */
    const int64_t *token_ids;     /* [B] */
    const int64_t *positions;     /* [B] */
    const int64_t *slots;         /* [B]: block * block_size + offset of the new token */
    const int64_t *block_tables;  /* [B, max_blocks] */
    int64_t max_blocks;
    const int64_t *context_lens;  /* [B]: tokens in the cache, the new one included */
    float *logits;                /* [B, vocab] */
} Step;

typedef struct Decoder Decoder;

typedef struct {
    Decoder *dec;
    int tid, num_threads;
    float *scores; /* attention scratch: [heads per KV head, context] */
    int64_t scores_cap;
    float tile_out[MAX_BATCH][16]; /* one panel pair's results */
    float *dequant; /* [K, 16]: one panel pair dequantized (larger batches) */
    int64_t dequant_cap;
    float *rows; /* [MAX_BATCH, hidden]: one expert's input rows, gathered (MoE) */
} Worker;

/* One MoE layer's routing of the step's tokens: the (token, expert) pairs sorted by expert. */
typedef struct {
    float *logits;        /* [B, num_experts padded to 8] */
    float *weight;        /* [B, top_k]: each token's routing weights */
    int64_t *expert;      /* [B, top_k]: ... and experts */
    int64_t *pair_token;  /* [B top_k]: the pairs' tokens, expert by expert */
    int64_t *pair_of;     /* [B, top_k]: where each token's j-th pair lies in that order */
    int64_t *count, *start, *active; /* per expert: pairs, first pair; active: the experts with pairs */
    int64_t num_active;
    float *act;           /* [B top_k, Im]: each pair's SwiGLU activations */
    float *y;             /* [B top_k, hidden]: each pair's expert output */
    float *shared_act, *shared_y; /* [B, Is], [B, hidden]: the shared expert's (Qwen2-MoE) */
} Moe;

struct Decoder {
    Model m;
    int num_threads;
    /* activations, [B, ...] each */
    float *resid, *normed, *qkv, *attn, *act, *out;
    void *xq; /* the input rows of a quantized product as 8-bit blocks: [QUANT_DOT_MAX_BATCH, max K / 32] */
    int scalar_kquants; /* K-quant dot products by the portable loop (the reference the AVX2 one is tested against) */
    Worker workers[MAX_THREADS];
    const Step *step;
    Moe moe;
};

/* ---- small vector helpers ---------------------------------------------------------- */

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* exp(x) for 8 lanes: Cephes' range reduction and degree-5 polynomial (~1 ulp on [-87, 88]). */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline __m256 silu8(__m256 g) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

/* max(p[0..n)), 8 lanes at a time (the compiler keeps a scalar chain: NaN rules), n >= 1 */
static inline float max_of(const float *p, int64_t n) {
    int64_t t = 0;
    float m = p[0];
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(p);
        for (t = 8; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(p + t));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
    for (; t < n; t++) m = p[t] > m ? p[t] : m;
    return m;
}

/* p[0..n) = exp(p - m), 8 lanes at a time; returns sum0 plus their sum (a softmax's denominator) */
static inline float exp_shifted(float *p, int64_t n, float m, float sum0) {
    int64_t t = 0;
    __m256 vs = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(m)));
        _mm256_storeu_ps(p + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    float sum = sum0 + hsum(vs);
    for (; t < n; t++) sum += (p[t] = expf(p[t] - m));
    return sum;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i < n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    return hsum(_mm256_add_ps(s0, s1));
}

/* ---- work sharing ---------------------------------------------------------------- */

static inline void barrier(void) {
#pragma omp barrier
}

/* [begin, end) of n items for this thread */
static void share(const Worker *w, int64_t n, int64_t *begin, int64_t *end) {
    int64_t t = w->num_threads;
    *begin = n * w->tid / t;
    *end = n * (w->tid + 1) / t;
}

/* ---- matrix-vector products over panels -------------------------------------------- */

/* One panel (8 output rows) times one input, with four partial sums: a single FMA chain
 * would wait on its own latency, and batch 1 must stream weights at full bandwidth. */
static inline __m256 panel_times_one(const float *w, const float *x, int64_t K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K; k += 4) {
        a0 = _mm256_fmadd_ps(_mm256_load_ps(w + 8 * k), _mm256_broadcast_ss(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_load_ps(w + 8 * k + 8), _mm256_broadcast_ss(x + k + 1), a1);
        a2 = _mm256_fmadd_ps(_mm256_load_ps(w + 8 * k + 16), _mm256_broadcast_ss(x + k + 2), a2);
        a3 = _mm256_fmadd_ps(_mm256_load_ps(w + 8 * k + 24), _mm256_broadcast_ss(x + k + 3), a3);
    }
    return _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
}

/* NP panels (1 or 2: 8 or 16 rows) times NB inputs (<= 6): 12 accumulators, each weight load
 * feeding NB FMAs, each broadcast NP (the register tile of BLIS's AVX2 kernels). Row k of a
 * panel (its 8 weights of input k) starts ldw floats after row k - 1. */
static inline __attribute__((always_inline)) void tile_strided(const float *w0, const float *w1, int64_t ldw, const float *x,
                                                               int64_t K, const int NB, const int NP, float (*out)[16]) {
    __m256 acc[6][2];
    for (int b = 0; b < NB; b++)
        for (int p = 0; p < NP; p++) acc[b][p] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 wa = _mm256_loadu_ps(w0 + ldw * k), wb = NP == 2 ? _mm256_loadu_ps(w1 + ldw * k) : wa;
        for (int b = 0; b < NB; b++) {
            __m256 xb = _mm256_broadcast_ss(x + b * K + k);
            acc[b][0] = _mm256_fmadd_ps(wa, xb, acc[b][0]);
            if (NP == 2) acc[b][1] = _mm256_fmadd_ps(wb, xb, acc[b][1]);
        }
    }
    for (int b = 0; b < NB; b++)
        for (int p = 0; p < NP; p++) _mm256_storeu_ps(out[b] + 8 * p, acc[b][p]);
}

/* out[b][0..8 NP) = x_b . (the NP 8-wide columns at w0 and w1, whose rows lie ldw floats
 * apart: 8 in a weight panel) for the B rows of x [B, K], 6 rows at a time in constant tile
 * shapes so that the accumulators stay in registers. */
#ifdef __AVX512F__
/* With AVX-512 (the library is built with it where the CPU has it): both panels in one 16-wide
 * register, NB <= 12 inputs a tile: 12 accumulators, each weight row feeding 12 FMAs whose
 * broadcast operand comes straight from memory. Twice the work an instruction of the AVX2 tile. */
static inline __attribute__((always_inline)) void tile_pair512(const float *w0, const float *w1, int64_t ldw, const float *x,
                                                               int64_t K, const int NB, float (*out)[16]) {
    __m512 acc[12];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(w0 + ldw * k)));
        __m512 wk = _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(w1 + ldw * k)), 1));
        for (int b = 0; b < NB; b++) acc[b] = _mm512_fmadd_ps(wk, _mm512_set1_ps(x[b * K + k]), acc[b]);
    }
    for (int b = 0; b < NB; b++) _mm512_storeu_ps(out[b], acc[b]);
}

#define PAIR512_CASE(n) \
    case n: tile_pair512(w0, w1, ldw, xb, K, n, ob); break;
#endif

static void tile_rows(const float *w0, const float *w1, int64_t ldw, const float *x, int64_t B, int64_t K, int NP,
                      float (*out)[16]) {
#ifdef __AVX512F__
    if (NP == 2) {
        for (int64_t b = 0; b < B; b += 12) {
            const float *xb = x + b * K;
            float (*ob)[16] = out + b;
            switch (B - b < 12 ? (int)(B - b) : 12) {
            PAIR512_CASE(1) PAIR512_CASE(2) PAIR512_CASE(3) PAIR512_CASE(4) PAIR512_CASE(5) PAIR512_CASE(6)
            PAIR512_CASE(7) PAIR512_CASE(8) PAIR512_CASE(9) PAIR512_CASE(10) PAIR512_CASE(11)
            default: tile_pair512(w0, w1, ldw, xb, K, 12, ob); break;
            }
        }
        return;
    }
#endif
    for (int64_t b = 0; b < B; b += 6) {
        const float *xb = x + b * K;
        float (*ob)[16] = out + b;
        switch ((B - b < 6 ? (int)(B - b) : 6) * 2 + (NP == 2)) {
        case 2: tile_strided(w0, w1, ldw, xb, K, 1, 1, ob); break;
        case 3: tile_strided(w0, w1, ldw, xb, K, 1, 2, ob); break;
        case 4: tile_strided(w0, w1, ldw, xb, K, 2, 1, ob); break;
        case 5: tile_strided(w0, w1, ldw, xb, K, 2, 2, ob); break;
        case 6: tile_strided(w0, w1, ldw, xb, K, 3, 1, ob); break;
        case 7: tile_strided(w0, w1, ldw, xb, K, 3, 2, ob); break;
        case 8: tile_strided(w0, w1, ldw, xb, K, 4, 1, ob); break;
        case 9: tile_strided(w0, w1, ldw, xb, K, 4, 2, ob); break;
        case 10: tile_strided(w0, w1, ldw, xb, K, 5, 1, ob); break;
        case 11: tile_strided(w0, w1, ldw, xb, K, 5, 2, ob); break;
        case 12: tile_strided(w0, w1, ldw, xb, K, 6, 1, ob); break;
        default: tile_strided(w0, w1, ldw, xb, K, 6, 2, ob); break;
        }
    }
}

/* Rows [16 pair, 16 pair + 16) of W (panels 2 pair and 2 pair + 1; the second may not exist)
 * times the B inputs x [B, K]: out[b][0..16). */
static void panel_pair(const float *W, int64_t pair, int64_t num_panels, const float *x, int64_t B, int64_t K,
                       float (*out)[16]) {
    const float *w0 = W + 2 * pair * 8 * K, *w1 = w0 + 8 * K;
    int two = 2 * pair + 1 < num_panels;
    if (B == 1) {
        _mm256_storeu_ps(out[0], panel_times_one(w0, x, K));
        if (two) _mm256_storeu_ps(out[0] + 8, panel_times_one(w1, x, K));
        return;
    }
    tile_rows(w0, w1, 8, x, B, K, two ? 2 : 1, out);
}

/* ---- quantized weights ------------------------------------------------------------- */

typedef struct { uint16_t d; uint8_t qs[QK / 2]; } BlockQ4_0;           /* w = d (q - 8) */
typedef struct { uint16_t d, m; uint8_t qs[QK / 2]; } BlockQ4_1;        /* w = d q + m */
typedef struct { uint16_t d; int8_t qs[QK]; } BlockQ8_0;                /* w = d q */
typedef struct { float d, s; int8_t qs[QK]; } BlockQ8X;                 /* an input block: x = d q, s = d sum(q) */
/* K-quants (llama.cpp's ggml-common.h): 256 weights a super-block, a 6-bit scale (and min) per 32
 * (Q4_K, Q5_K: w = d sc q - dmin m, q in 0..15 or 0..31) or an 8-bit scale per 16 (Q6_K: w = d sc q,
 * q in -32..31). Q4_K's 4-bit values go 64 at a time: 32 bytes, low nibbles the first 32, high the next. */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[QK_K / 2]; } BlockQ4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[QK_K / 8]; uint8_t qs[QK_K / 2]; } BlockQ5_K; /* bit 4 of value 32 j + l: bit j of qh[l] */
typedef struct { uint8_t ql[QK_K / 2]; uint8_t qh[QK_K / 4]; int8_t scales[QK_K / 16]; uint16_t d; } BlockQ6_K;

static inline int is_kquant(int64_t type) { return type == TYPE_Q4_K || type == TYPE_Q5_K || type == TYPE_Q6_K; }

/* bytes of one row of K weights */
static inline int64_t row_bytes(int64_t type, int64_t K) {
    switch (type) {
    case TYPE_Q4_0: return K / QK * sizeof(BlockQ4_0);
    case TYPE_Q4_1: return K / QK * sizeof(BlockQ4_1);
    case TYPE_Q8_0: return K / QK * sizeof(BlockQ8_0);
    case TYPE_Q4_K: return K / QK_K * sizeof(BlockQ4_K);
    case TYPE_Q5_K: return K / QK_K * sizeof(BlockQ5_K);
    default: return K / QK_K * sizeof(BlockQ6_K);
    }
}

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* the 32 4-bit values of a block, in order: byte j holds value j (low nibble) and j + 16 (high) */
static inline __m256i nibbles(const uint8_t *qs) {
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

/* sum of u[i] * s[i] (unsigned times signed bytes) in 8 float lanes */
static inline __m256 dot_bytes(__m256i u, __m256i s) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

/* x[0..K) as 8-bit blocks, one scale per 32 values (round to nearest, as llama.cpp's Q8) */
static void quantize_row(const float *x, int64_t K, BlockQ8X *out) {
    for (int64_t i = 0; i < K / QK; i++) {
        const float *v = x + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        float d = amax / 127.0f, inv = d ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(v[j] * inv);
            out[i].qs[j] = (int8_t)q;
            sum += q;
        }
        out[i].d = d;
        out[i].s = d * (float)sum;
    }
}

/* ---- K-quants ---- */

/* sub-block j's 6-bit scale and min of a Q4_K/Q5_K super-block (llama.cpp's get_scale_min_k4) */
static inline void scale_min_k4(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One K-quant super-block as integers: w[n] = scale[n / 16] q[n] - min[n / 16] (the order and
 * float products of gguf.quants' dequantizers). The portable path: dequantization, and the
 * scalar dot product. */
static void unpack_kquant(int64_t type, const uint8_t *block, int8_t q[QK_K], float scale[16], float min[16]) {
    if (type == TYPE_Q6_K) {
        const BlockQ6_K *b = (const BlockQ6_K *)block;
        float d = half_to_float(b->d);
        for (int g = 0; g < 16; g++) scale[g] = d * (float)b->scales[g], min[g] = 0.0f;
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int l = 0; l < 32; l++) {
                    int lo = (b->ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0xF, hi = (b->qh[32 * h + l] >> (2 * s)) & 3;
                    q[128 * h + 32 * s + l] = (int8_t)((lo | hi << 4) - 32);
                }
        return;
    }
    const BlockQ4_K *b4 = (const BlockQ4_K *)block; /* Q5_K starts the same */
    const BlockQ5_K *b5 = (const BlockQ5_K *)block;
    const uint8_t *qs = type == TYPE_Q4_K ? b4->qs : b5->qs;
    float d = half_to_float(b4->d), dmin = half_to_float(b4->dmin);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min_k4(b4->scales, j, &sc, &m);
        scale[2 * j] = scale[2 * j + 1] = d * (float)sc;
        min[2 * j] = min[2 * j + 1] = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int v = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xF;
            if (type == TYPE_Q5_K) v |= ((b5->qh[l] >> j) & 1) << 4;
            q[32 * j + l] = (int8_t)v;
        }
    }
}

static int64_t kquant_block_bytes(int64_t type) { return row_bytes(type, QK_K); }

/* one K-quant row of K weights . one quantized input row, in plain C (any CPU) */
static float dot_row_kquant_scalar(int64_t type, const uint8_t *row, const BlockQ8X *x, int64_t K) {
    int8_t q[QK_K];
    float scale[16], min[16], sum = 0.0f;
    for (int64_t i = 0; i < K / QK_K; i++) {
        unpack_kquant(type, row + i * kquant_block_bytes(type), q, scale, min);
        for (int g = 0; g < 16; g++) {
            const BlockQ8X *xb = x + 8 * i + g / 2;
            int dot = 0, xs = 0;
            for (int l = 16 * (g & 1); l < 16 * (g & 1) + 16; l++) dot += q[16 * g + l - 16 * (g & 1)] * xb->qs[l], xs += xb->qs[l];
            sum += xb->d * (scale[g] * (float)dot - min[g] * (float)xs);
        }
    }
    return sum;
}

/* Q4_K / Q5_K row . input row, AVX2: each sub-block of 32 is one unsigned-by-signed byte product
 * (maddubs) scaled by its weight scale times the input block's; the mins come off through the
 * input blocks' sums. */
static float dot_row_q45k(int64_t type, const uint8_t *row, const BlockQ8X *x, int64_t K) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    float mins = 0.0f;
    int64_t stride = kquant_block_bytes(type);
    for (int64_t i = 0; i < K / QK_K; i++) {
        const BlockQ4_K *b4 = (const BlockQ4_K *)(row + i * stride);
        const BlockQ5_K *b5 = (const BlockQ5_K *)b4;
        const uint8_t *qs = type == TYPE_Q4_K ? b4->qs : b5->qs;
        const BlockQ8X *xb = x + 8 * i;
        float d = half_to_float(b4->d), dmin = half_to_float(b4->dmin);
        __m256i qh = type == TYPE_Q5_K ? _mm256_loadu_si256((const __m256i *)b5->qh) : _mm256_setzero_si256();
        for (int j = 0; j < 8; j += 2) {
            int sc0, m0, sc1, m1;
            scale_min_k4(b4->scales, j, &sc0, &m0);
            scale_min_k4(b4->scales, j + 1, &sc1, &m1);
            __m256i bytes = _mm256_loadu_si256((const __m256i *)(qs + 16 * j));
            __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            if (type == TYPE_Q5_K) { /* bit j (j + 1) of each qh byte is bit 4 of the value */
                lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j + 1), one), 4));
            }
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc0 * xb[j].d), dot_bytes(lo, _mm256_loadu_si256((const __m256i *)xb[j].qs)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * (float)sc1 * xb[j + 1].d), dot_bytes(hi, _mm256_loadu_si256((const __m256i *)xb[j + 1].qs)), acc1);
            mins += dmin * ((float)m0 * xb[j].s + (float)m1 * xb[j + 1].s);
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1)) - mins;
}

/* Q6_K row . input row, AVX2: the signed 6-bit values times the input bytes (|w| times x with
 * w's sign), pairs summed against the two 16-value scales of the sub-block (madd), then one
 * float scale per input block. */
static float dot_row_q6k(const uint8_t *row, const BlockQ8X *x, int64_t K) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
    const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), bias = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < K / QK_K; i++) {
        const BlockQ6_K *b = (const BlockQ6_K *)row + i;
        float d = half_to_float(b->d);
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
            for (int s = 0; s < 4; s++) {
                __m256i nib = s & 1 ? ql1 : ql0;
                nib = _mm256_and_si256(s >> 1 ? _mm256_srli_epi16(nib, 4) : nib, low4);
                __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * s), three), 4);
                __m256i w = _mm256_sub_epi8(_mm256_or_si256(nib, high), bias);
                const BlockQ8X *xb = x + 8 * i + 4 * h + s;
                const int8_t *sc = b->scales + 8 * h + 2 * s;
                __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)xb->qs), w));
                __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[1]), _mm_set1_epi16(sc[0])); /* values 0-15, 16-31 */
                __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, scales));
                if (s & 1) acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), p, acc1);
                else acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d * xb->d), p, acc0);
            }
        }
    }
    return hsum(_mm256_add_ps(acc0, acc1));
}

/* one weight row of nb blocks of 32 . one quantized input row */
static float dot_row(int64_t type, const uint8_t *row, const BlockQ8X *x, int64_t nb, int scalar_kquants) {
    if (is_kquant(type)) {
        if (scalar_kquants) return dot_row_kquant_scalar(type, row, x, nb * QK);
        return type == TYPE_Q6_K ? dot_row_q6k(row, x, nb * QK) : dot_row_q45k(type, row, x, nb * QK);
    }
    __m256 acc = _mm256_setzero_ps();
    float extra = 0.0f;
    if (type == TYPE_Q4_1) {
        const BlockQ4_1 *w = (const BlockQ4_1 *)row;
        for (int64_t i = 0; i < nb; i++) {
            __m256 p = dot_bytes(nibbles(w[i].qs), _mm256_loadu_si256((const __m256i *)x[i].qs));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[i].d) * x[i].d), p, acc);
            extra += half_to_float(w[i].m) * x[i].s;
        }
    } else if (type == TYPE_Q4_0) {
        const BlockQ4_0 *w = (const BlockQ4_0 *)row;
        for (int64_t i = 0; i < nb; i++) {
            float dw = half_to_float(w[i].d);
            __m256 p = dot_bytes(nibbles(w[i].qs), _mm256_loadu_si256((const __m256i *)x[i].qs));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[i].d), p, acc);
            extra -= 8.0f * dw * x[i].s;
        }
    } else {
        const BlockQ8_0 *w = (const BlockQ8_0 *)row;
        for (int64_t i = 0; i < nb; i++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)w[i].qs);
            __m256i xs = _mm256_loadu_si256((const __m256i *)x[i].qs);
            __m256 p = dot_bytes(_mm256_abs_epi8(q), _mm256_sign_epi8(xs, q)); /* |w| times x with w's sign */
            acc = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(w[i].d) * x[i].d), p, acc);
        }
    }
    return hsum(acc) + extra;
}

/* row[0..K) as floats at out[0], out[stride], out[2 stride], ... */
static void dequantize_row(int64_t type, const uint8_t *row, int64_t K, float *out, int64_t stride) {
    if (is_kquant(type)) {
        int8_t q[QK_K];
        float scale[16], min[16];
        for (int64_t i = 0; i < K / QK_K; i++) {
            unpack_kquant(type, row + i * kquant_block_bytes(type), q, scale, min);
            for (int n = 0; n < QK_K; n++) out[(i * QK_K + n) * stride] = scale[n / 16] * (float)q[n] - min[n / 16];
        }
        return;
    }
    for (int64_t i = 0; i < K / QK; i++) {
        float *o = out + i * QK * stride;
        if (type == TYPE_Q8_0) {
            const BlockQ8_0 *b = (const BlockQ8_0 *)row + i;
            float d = half_to_float(b->d);
            for (int j = 0; j < QK; j++) o[j * stride] = d * b->qs[j];
        } else {
            const BlockQ4_1 *b1 = (const BlockQ4_1 *)row + i;
            const BlockQ4_0 *b0 = (const BlockQ4_0 *)row + i;
            float d = half_to_float(type == TYPE_Q4_1 ? b1->d : b0->d);
            float m = type == TYPE_Q4_1 ? half_to_float(b1->m) : -8.0f * d;
            const uint8_t *qs = type == TYPE_Q4_1 ? b1->qs : b0->qs;
            for (int j = 0; j < QK / 2; j++) {
                o[j * stride] = d * (qs[j] & 0x0F) + m;
                o[(j + QK / 2) * stride] = d * (qs[j] >> 4) + m;
            }
        }
    }
}

/* Rows [16 pair, 16 pair + 16) of a quantized W (of N rows) times the B inputs: out[b][0..16).
 * Small batches: integer dot products against the inputs' 8-bit blocks xq; larger ones: the
 * rows dequantized into a [K, 16] float panel (the layout of two 8-row panels side by side). */
static void quant_pair(Worker *w, const Mat *W, int64_t pair, int64_t N, const float *x, const BlockQ8X *xq, int64_t B,
                       int64_t K, float (*out)[16]) {
    int64_t rows = N - 16 * pair < 16 ? N - 16 * pair : 16, bytes = row_bytes(W->type, K);
    const uint8_t *first = W->blocks + 16 * pair * bytes;
    if (B <= QUANT_DOT_MAX_BATCH) {
        for (int64_t j = 0; j < rows; j++)
            for (int64_t b = 0; b < B; b++)
                out[b][j] = dot_row(W->type, first + j * bytes, xq + b * (K / QK), K / QK, w->dec->scalar_kquants);
        return;
    }
    if (w->dequant_cap < 16 * K) {
        free(w->dequant);
        w->dequant_cap = 16 * K;
        w->dequant = aligned_alloc(64, ((16 * K * sizeof(float) + 63) / 64) * 64);
    }
    float *panel = w->dequant;
    for (int64_t j = 0; j < 16; j++) {
        if (j < rows) dequantize_row(W->type, first + j * bytes, K, panel + j, 16);
        else for (int64_t k = 0; k < K; k++) panel[16 * k + j] = 0.0f;
    }
    tile_rows(panel, panel + 8, 16, x, B, K, rows > 8 ? 2 : 1, out);
}

/* Before a quantized product of a small batch: every thread quantizes its share of the input
 * rows x [B, K] into the decoder's xq, then all wait for the whole batch. */
static const BlockQ8X *quantize_inputs(Worker *w, const Mat *W, const float *x, int64_t B, int64_t K) {
    BlockQ8X *xq = w->dec->xq;
    if (W->type == TYPE_F32_PANELS || B > QUANT_DOT_MAX_BATCH) return xq;
    int64_t b0, b1;
    share(w, B, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) quantize_row(x + b * K, K, xq + b * (K / QK));
    barrier();
    return xq;
}

/* y[b, n] = x_b . W[n] (+ bias[n]) for this thread's share of W's rows, 16 at a time; y has
 * row stride ldy, and only rows n < n_valid are stored (the LM head's last panel may be padding). */
static void matvec(Worker *w, Mat W, const float *bias, const float *x, int64_t B, int64_t K,
                   int64_t N, int64_t n_valid, float *y, int64_t ldy) {
    int64_t panels = N / 8, q0, q1;
    const BlockQ8X *xq = quantize_inputs(w, &W, x, B, K);
    share(w, (panels + 1) / 2, &q0, &q1);
    float (*out)[16] = w->tile_out;
    for (int64_t q = q0; q < q1; q++) {
        if (W.type && (B <= QUANT_DOT_MAX_BATCH || !W.panels)) quant_pair(w, &W, q, n_valid, x, xq, B, K, out);
        else panel_pair(W.panels, q, panels, x, B, K, out);
        int64_t rows = n_valid - 16 * q < 16 ? n_valid - 16 * q : 16;
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < rows; j++) y[b * ldy + 16 * q + j] = out[b][j] + (bias ? bias[16 * q + j] : 0.0f);
    }
}

/* act[b, i] = silu(gate_i . x_b) * (up_i . x_b): the gate/up weight alternates 8-row panels,
 * so each panel pair is 8 gate rows and their 8 up rows. */
static void gate_up_silu(Worker *w, Mat W, const float *x, int64_t B, int64_t K, int64_t I, float *act) {
    int64_t q0, q1;
    const BlockQ8X *xq = quantize_inputs(w, &W, x, B, K);
    share(w, I / 8, &q0, &q1);
    float (*out)[16] = w->tile_out;
    for (int64_t q = q0; q < q1; q++) {
        if (W.type && (B <= QUANT_DOT_MAX_BATCH || !W.panels)) quant_pair(w, &W, q, 2 * I, x, xq, B, K, out);
        else panel_pair(W.panels, q, 2 * (I / 8), x, B, K, out);
        for (int64_t b = 0; b < B; b++) {
            _mm256_storeu_ps(act + b * I + q * 8, _mm256_mul_ps(silu8(_mm256_loadu_ps(out[b])), _mm256_loadu_ps(out[b] + 8)));
        }
    }
}

/* ---- the small ops ----------------------------------------------------------------- */

/* resid[b] += add[b] (when add), then normed[b] = rmsnorm(resid[b]) * weight; rows split over threads. */
static void add_rms_norm(Worker *w, float *resid, const float *add, const float *weight, float *normed) {
    const Model *m = &w->dec->m;
    int64_t H = m->hidden, b0, b1;
    share(w, w->dec->step->batch, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) {
        float *r = resid + b * H;
        if (add)
            for (int64_t i = 0; i < H; i++) r[i] += add[b * H + i];
        float ss = dot(r, r, H);
        float inv = 1.0f / sqrtf(ss / (float)H + (float)m->eps);
        for (int64_t i = 0; i < H; i++) normed[b * H + i] = r[i] * inv * weight[i];
    }
}

/* RMSNorm of one head in place (Qwen3's q/k norms) */
static void head_rms_norm(float *x, const float *weight, int64_t d, float eps) {
    float inv = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int64_t i = 0; i < d; i++) x[i] = x[i] * inv * weight[i];
}

/* neox RoPE of one head in place: pairs (i, i + d/2) */
static void rotate(float *x, const float *cs, int64_t d) {
    int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        float x1 = x[i], x2 = x[i + half], c = cs[i], s = cs[half + i];
        x[i] = x1 * c - x2 * s;
        x[i + half] = x2 * c + x1 * s;
    }
}

/* Ask for the n floats at p, a line at a time. A sequence's cache blocks lie anywhere in the
 * pool and the hardware prefetcher stops at each block's end, so attention fetches the next
 * block while it works on this one (B = 16, contexts ~400: a decode step 8% faster). */
static inline void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) _mm_prefetch((const char *)(p + i), _MM_HINT_T0);
}

/* lane i of the result = the sum of the lanes of a[i] */
static inline __m256 hsum8(const __m256 a[8]) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* softmax(q_j . K^T * scale) V for the g query heads q [g, d] that share one KV head, over the
 * ctx tokens of a sequence's blocks (keys/values: that head's [blocks, bs, d]); out [g, d].
 * Keys go 8 at a time (8 accumulators reduced together); values go by 32-wide column strips
 * for 3 heads at once, so that each value row is read once and the sums stay in registers. */
static void attend_head_group(const float *q, const float *keys, const float *values, const int64_t *table,
                              int64_t bs, int64_t ctx, int64_t g, int64_t d, float scale, float *scores, float *out) {
    int64_t num_blocks = (ctx + bs - 1) / bs;
    for (int64_t blk = 0; blk * bs < ctx; blk++) {
        const float *kb = keys + table[blk] * bs * d;
        if (blk + 1 < num_blocks) prefetch(keys + table[blk + 1] * bs * d, bs * d);
        int64_t n = ctx - blk * bs < bs ? ctx - blk * bs : bs, o = 0;
        for (; o + 8 <= n; o += 8) {
            for (int64_t j = 0; j < g; j++) {
                __m256 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t c = 0; c < d; c += 8) {
                    __m256 qv = _mm256_loadu_ps(q + j * d + c);
                    for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(kb + (o + i) * d + c), qv, acc[i]);
                }
                _mm256_storeu_ps(scores + j * ctx + blk * bs + o, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
            }
        }
        for (; o < n; o++)
            for (int64_t j = 0; j < g; j++) scores[j * ctx + blk * bs + o] = dot(q + j * d, kb + o * d, d) * scale;
    }
    for (int64_t j = 0; j < g; j++) {
        float *p = scores + j * ctx, inv = 1.0f / exp_shifted(p, ctx, max_of(p, ctx), 0.0f);
        for (int64_t t = 0; t < ctx; t++) p[t] *= inv;
    }
    prefetch(values + table[0] * bs * d, bs * d);
    for (int64_t c = 0; c < d; c += 32) {
        for (int64_t j0 = 0; j0 < g; j0 += 3) {
            __m256 acc[3][4];
            for (int jj = 0; jj < 3; jj++)
                for (int i = 0; i < 4; i++) acc[jj][i] = _mm256_setzero_ps();
            for (int64_t blk = 0; blk * bs < ctx; blk++) {
                const float *vb = values + table[blk] * bs * d + c;
                if (c == 0 && j0 == 0 && blk + 1 < num_blocks) prefetch(values + table[blk + 1] * bs * d, bs * d);
                int64_t n = ctx - blk * bs < bs ? ctx - blk * bs : bs;
                for (int64_t o = 0; o < n; o++) {
                    __m256 v[4];
                    for (int i = 0; i < 4; i++) v[i] = c + 8 * i < d ? _mm256_loadu_ps(vb + o * d + 8 * i) : _mm256_setzero_ps();
                    for (int jj = 0; jj < 3; jj++) {
                        if (j0 + jj >= g) break;
                        __m256 pj = _mm256_set1_ps(scores[(j0 + jj) * ctx + blk * bs + o]);
                        for (int i = 0; i < 4; i++) acc[jj][i] = _mm256_fmadd_ps(pj, v[i], acc[jj][i]);
                    }
                }
            }
            for (int jj = 0; jj < 3 && j0 + jj < g; jj++)
                for (int i = 0; i < 4 && c + 8 * i < d; i++) _mm256_storeu_ps(out + (j0 + jj) * d + c + 8 * i, acc[jj][i]);
        }
    }
}

/* [begin, end) of the step's n_items = B x kvh (sequence, KV head) items for this thread, cut
 * so that each thread reads about the same number of cached tokens (contexts within a batch
 * differ by 10x and more). An item weighs its context plus a fixed cost. */
static void share_by_context(const Worker *w, const Step *s, int64_t kvh, int64_t *begin, int64_t *end) { /* empty: begin >= end */
    int64_t n = s->batch * kvh, total = 0, seen = 0, t = w->num_threads;
    for (int64_t i = 0; i < n; i++) total += s->context_lens[i / kvh] + 16;
    *begin = *end = n;
    for (int64_t i = 0; i < n; i++) {
        int64_t weight = s->context_lens[i / kvh] + 16, owner = (seen + weight / 2) * t / total; /* where its midpoint falls */
        if (owner == w->tid && *begin == n) *begin = i;
        if (owner > w->tid) {
            *end = i;
            break;
        }
        seen += weight;
    }
}

/* For each (sequence, KV head) of this thread's share: rotate its queries and key, store the
 * key and value in the paged cache, then attend its g query heads over the sequence's context. */
static void attention(Worker *w, int64_t layer) {
    const Decoder *dec = w->dec;
    const Model *m = &dec->m;
    const Step *s = dec->step;
    int64_t h = m->num_heads, kvh = m->num_kv_heads, d = m->head_dim, g = h / kvh, bs = m->block_size;
    int64_t row = (h + 2 * kvh) * d;
    float *k_cache = m->kv[layer], *v_cache = k_cache + kvh * m->num_blocks * bs * d;
    int64_t i0, i1;
    share_by_context(w, s, kvh, &i0, &i1);
    for (int64_t item = i0; item < i1; item++) {
        int64_t b = item / kvh, kh = item % kvh, ctx = s->context_lens[b];
        float *q = dec->qkv + b * row + kh * g * d, *k = dec->qkv + b * row + (h + kh) * d, *v = k + kvh * d;
        const float *cs = m->cos_sin + s->positions[b] * d;
        if (m->q_norm) {
            for (int64_t j = 0; j < g; j++) head_rms_norm(q + j * d, m->q_norm[layer], d, (float)m->eps);
            head_rms_norm(k, m->k_norm[layer], d, (float)m->eps);
        }
        for (int64_t j = 0; j < g; j++) rotate(q + j * d, cs, d);
        rotate(k, cs, d);
        int64_t slot = (kh * m->num_blocks * bs + s->slots[b]) * d;
        memcpy(k_cache + slot, k, d * sizeof(float));
        memcpy(v_cache + slot, v, d * sizeof(float));

        if (g * ctx > w->scores_cap) {
            free(w->scores);
            w->scores_cap = 2 * g * ctx;
            w->scores = aligned_alloc(32, w->scores_cap * sizeof(float));
        }
        const int64_t *table = s->block_tables + b * s->max_blocks;
        const float *keys = k_cache + kh * m->num_blocks * bs * d, *values = v_cache + kh * m->num_blocks * bs * d;
        if (item + 1 < i1) { /* the next item's first key block, which would otherwise start cold */
            int64_t nb = (item + 1) / kvh, nkh = (item + 1) % kvh;
            prefetch(k_cache + (nkh * m->num_blocks + s->block_tables[nb * s->max_blocks]) * bs * d, bs * d);
        }
        attend_head_group(q, keys, values, table, bs, ctx, g, d, (float)m->scale, w->scores, dec->attn + b * h * d + kh * g * d);
    }
}

/* ---- the step ---------------------------------------------------------------------- */

/* layer l's matrix i (qkv, o, gate_up, down); l = num_layers: the LM head */
static Mat weight(const Model *m, int64_t l, int i) {
    int64_t type = m->types ? m->types[4 * l + i] : TYPE_F32_PANELS;
    if (l == m->num_layers) return (Mat){m->lm_head, m->lm_head_q, type};
    const float **panels[4] = {m->qkv, m->o, m->gate_up, m->down};
    const uint8_t **blocks[4] = {m->qkv_q, m->o_q, m->gate_up_q, m->down_q};
    return (Mat){panels[i][l], type ? blocks[i][l] : NULL, type};
}

/* ---- mixture-of-experts layers ------------------------------------------------------ */

/* Each of this thread's tokens: softmax over the router's logits, the top_k largest (ties: the
 * lower expert), renormalised to sum 1 where norm_topk_prob; as transformers' routers do it
 * (Mixtral, Qwen3-MoE: softmax, topk, divide by the top-k's sum, all float32). */
static void route(Worker *w) {
    Moe *g = &w->dec->moe;
    const Model *m = &w->dec->m;
    int64_t E = m->num_experts, k = m->top_k, ld = (E + 7) / 8 * 8, b0, b1;
    share(w, w->dec->step->batch, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) {
        float *p = g->logits + b * ld, mx = max_of(p, E), sum = 0.0f;
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
        float *wt = g->weight + b * k, total = 0.0f;
        int64_t *ids = g->expert + b * k;
        for (int64_t j = 0; j < k; j++) { /* k passes: k is small (2-8) */
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            ids[j] = best, wt[j] = p[best] / sum;
            p[best] = -1.0f; /* taken */
        }
        for (int64_t j = 0; j < k; j++) total += wt[j]; /* in descending order, as torch's sum of topk's values */
        if (m->norm_topk_prob)
            for (int64_t j = 0; j < k; j++) wt[j] /= total;
    }
}

/* The pairs sorted by expert (one thread: B top_k entries). */
static void group_pairs(Decoder *dec) {
    Moe *g = &dec->moe;
    int64_t E = dec->m.num_experts, k = dec->m.top_k, n = dec->step->batch * k;
    memset(g->count, 0, E * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) g->count[g->expert[i]]++;
    g->num_active = 0;
    for (int64_t e = 0, at = 0; e < E; e++) {
        g->start[e] = at;
        at += g->count[e];
        if (g->count[e]) g->active[g->num_active++] = e;
    }
    for (int64_t e = 0; e < E; e++) g->count[e] = 0; /* refilled below, as each expert's next free place */
    for (int64_t i = 0; i < n; i++) {
        int64_t e = g->expert[i], at = g->start[e] + g->count[e]++;
        g->pair_token[at] = i / k;
        g->pair_of[i] = at;
    }
}

#define MOE_ITEM_COST 8 /* an item's fixed cost in rows: streaming its 16 weight rows once */

/* The first of the items (active expert a, one of `per` panel pairs) whose midpoint, in work,
 * reaches x: an item weighs its expert's rows plus MOE_ITEM_COST. */
static int64_t first_item(const Moe *g, int64_t per, int64_t x) {
    int64_t acc = 0;
    for (int64_t a = 0; a < g->num_active; a++) {
        int64_t wt = g->count[g->active[a]] + MOE_ITEM_COST, span = per * wt;
        if (2 * (acc + span) - wt >= 2 * x) {
            int64_t need = 2 * (x - acc) - wt; /* item j's midpoint: acc + j wt + wt / 2 */
            return a * per + (need <= 0 ? 0 : (need + 2 * wt - 1) / (2 * wt));
        }
        acc += span;
    }
    return g->num_active * per;
}

/* [begin, end) of the items for this thread: all active experts' panel pairs in one phase,
 * cut by work (so one barrier a phase, not one an expert; few rows an expert at decode). */
static void share_items(const Worker *w, int64_t per, int64_t *begin, int64_t *end) {
    const Moe *g = &w->dec->moe;
    int64_t total = 0;
    for (int64_t a = 0; a < g->num_active; a++) total += per * (g->count[g->active[a]] + MOE_ITEM_COST);
    *begin = first_item(g, per, total * w->tid / w->num_threads);
    *end = w->tid + 1 == w->num_threads ? g->num_active * per : first_item(g, per, total * (w->tid + 1) / w->num_threads);
}

/* dec->out = the MoE block of layer l on dec->normed: route, group the pairs by expert, each
 * expert's gate_up + SwiGLU then down on just its rows (the dense MLP's tiles), then each
 * token's weighted sum of its experts' outputs. */
__attribute__((noinline)) static void moe_block(Worker *w, int64_t l) { /* noinline: a profile names its share */
    Decoder *dec = w->dec;
    const Model *m = &dec->m;
    Moe *g = &dec->moe;
    int64_t B = dec->step->batch, H = m->hidden, Im = m->moe_intermediate, k = m->top_k, E = m->num_experts;
    int64_t ld = (E + 7) / 8 * 8, i0, i1;
    matvec(w, (Mat){m->router[l], NULL, TYPE_F32_PANELS}, NULL, dec->normed, B, H, ld, E, g->logits, ld);
    barrier();
    route(w);
    barrier();
    if (w->tid == 0) group_pairs(dec);
    barrier();
    int shared = m->shared_gate_up && m->shared_gate_up[l];
    if (shared) /* every token through the shared expert: its phases beside the routed experts' */
        gate_up_silu(w, (Mat){m->shared_gate_up[l], NULL, TYPE_F32_PANELS}, dec->normed, B, H, m->shared_intermediate, g->shared_act);
    float (*out)[16] = w->tile_out;
    int64_t per = Im / 8, gathered = -1; /* gate_up: 8 gate rows and their 8 up rows an item */
    share_items(w, per, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) {
        int64_t a = it / per, q = it % per, e = g->active[a], n = g->count[e], first = g->start[e];
        if (gathered != e) { /* this expert's rows, contiguous for the tiles */
            for (int64_t r = 0; r < n; r++) memcpy(w->rows + r * H, dec->normed + g->pair_token[first + r] * H, H * sizeof(float));
            gathered = e;
        }
        panel_pair(m->expert_gate_up[l] + e * 2 * Im * H, q, 2 * per, w->rows, n, H, out);
        for (int64_t r = 0; r < n; r++)
            _mm256_storeu_ps(g->act + (first + r) * Im + q * 8, _mm256_mul_ps(silu8(_mm256_loadu_ps(out[r])), _mm256_loadu_ps(out[r] + 8)));
    }
    barrier();
    if (shared)
        matvec(w, (Mat){m->shared_down[l], NULL, TYPE_F32_PANELS}, NULL, g->shared_act, B, m->shared_intermediate, H, H, g->shared_y, H);
    per = (H / 8 + 1) / 2; /* down: 16 output rows an item (the last may have 8) */
    share_items(w, per, &i0, &i1);
    for (int64_t it = i0; it < i1; it++) {
        int64_t a = it / per, q = it % per, e = g->active[a], n = g->count[e], first = g->start[e];
        int64_t rows = H - 16 * q < 16 ? H - 16 * q : 16;
        panel_pair(m->expert_down[l] + e * H * Im, q, H / 8, g->act + first * Im, n, Im, out);
        for (int64_t r = 0; r < n; r++) memcpy(g->y + (first + r) * H + 16 * q, out[r], rows * sizeof(float));
    }
    barrier();
    int64_t b0, b1;
    share(w, B, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) {
        float *o = dec->out + b * H;
        memset(o, 0, H * sizeof(float));
        if (shared) { /* sigmoid(gate . x) times the shared expert's output */
            float gate = 1.0f / (1.0f + expf(-dot(dec->normed + b * H, m->shared_gate[l], H)));
            for (int64_t i = 0; i < H; i++) o[i] = gate * g->shared_y[b * H + i];
        }
        for (int64_t j = 0; j < k; j++) {
            __m256 wt = _mm256_set1_ps(g->weight[b * k + j]);
            const float *y = g->y + g->pair_of[b * k + j] * H;
            for (int64_t i = 0; i < H; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(wt, _mm256_loadu_ps(y + i), _mm256_loadu_ps(o + i)));
        }
    }
}

static void forward(Worker *w) {
    Decoder *dec = w->dec;
    const Model *m = &dec->m;
    const Step *s = dec->step;
    int64_t B = s->batch, H = m->hidden, I = m->intermediate;
    int64_t qkv_rows = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim, attn_width = m->num_heads * m->head_dim;

    int64_t b0, b1;
    share(w, B, &b0, &b1);
    for (int64_t b = b0; b < b1; b++) memcpy(dec->resid + b * H, m->embed + s->token_ids[b] * H, H * sizeof(float));
    for (int64_t l = 0; l < m->num_layers; l++) {
        add_rms_norm(w, dec->resid, l ? dec->out : NULL, m->input_norm[l], dec->normed);
        barrier();
        matvec(w, weight(m, l, 0), m->qkv_bias[l], dec->normed, B, H, qkv_rows, qkv_rows, dec->qkv, qkv_rows);
        barrier();
        attention(w, l);
        barrier();
        matvec(w, weight(m, l, 1), NULL, dec->attn, B, attn_width, H, H, dec->out, H);
        barrier();
        add_rms_norm(w, dec->resid, dec->out, m->post_norm[l], dec->normed);
        barrier();
        if (m->router && m->router[l]) {
            moe_block(w, l);
        } else {
            gate_up_silu(w, weight(m, l, 2), dec->normed, B, H, I, dec->act);
            barrier();
            matvec(w, weight(m, l, 3), NULL, dec->act, B, I, H, H, dec->out, H);
        }
        barrier();
    }
    add_rms_norm(w, dec->resid, dec->out, m->final_norm, dec->normed);
    barrier();
    matvec(w, weight(m, m->num_layers, 0), NULL, dec->normed, B, H, (m->vocab + 7) / 8 * 8, m->vocab, s->logits, m->vocab);
    barrier();
}

/* ---- the API (ctypes) -------------------------------------------------------------- */

static float *alloc_floats(int64_t n) {
    float *p = aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64);
    if (p) memset(p, 0, n * sizeof(float));
    return p;
}

int64_t shoal_max_batch(void) { return MAX_BATCH; }

Decoder *shoal_decoder_new(const Model *m, int64_t num_threads) {
    if (num_threads < 1 || num_threads > MAX_THREADS) return NULL;
    Decoder *d = calloc(1, sizeof(Decoder));
    d->m = *m; /* every array it points to stays owned (and alive) on the Python side */
    int64_t H = m->hidden, qkv_rows = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    d->resid = alloc_floats(MAX_BATCH * H);
    d->normed = alloc_floats(MAX_BATCH * H);
    d->out = alloc_floats(MAX_BATCH * H);
    d->qkv = alloc_floats(MAX_BATCH * qkv_rows);
    d->attn = alloc_floats(MAX_BATCH * m->num_heads * m->head_dim);
    d->act = alloc_floats(MAX_BATCH * m->intermediate);
    int64_t max_k = H > m->intermediate ? H : m->intermediate;
    max_k = max_k > m->num_heads * m->head_dim ? max_k : m->num_heads * m->head_dim;
    d->xq = calloc(QUANT_DOT_MAX_BATCH * (max_k / QK + 1), sizeof(BlockQ8X));
    d->num_threads = (int)num_threads;
    for (int t = 0; t < MAX_THREADS; t++) d->workers[t].dec = d;
    if (m->router) {
        int64_t E = m->num_experts, pairs = MAX_BATCH * m->top_k;
        Moe *g = &d->moe;
        g->logits = alloc_floats(MAX_BATCH * ((E + 7) / 8 * 8));
        g->weight = alloc_floats(pairs);
        g->expert = calloc(pairs, sizeof(int64_t)), g->pair_token = calloc(pairs, sizeof(int64_t));
        g->pair_of = calloc(pairs, sizeof(int64_t));
        g->count = calloc(E, sizeof(int64_t)), g->start = calloc(E, sizeof(int64_t)), g->active = calloc(E, sizeof(int64_t));
        g->act = alloc_floats(pairs * m->moe_intermediate);
        g->y = alloc_floats(pairs * H);
        for (int t = 0; t < num_threads; t++) d->workers[t].rows = alloc_floats(MAX_BATCH * H);
        if (m->shared_gate_up) g->shared_act = alloc_floats(MAX_BATCH * m->shared_intermediate), g->shared_y = alloc_floats(MAX_BATCH * H);
    }
    return d;
}

/* Runs one step on the caller's OpenMP team. Returns 0, or -1 for a batch too large. */
int64_t shoal_decoder_step(Decoder *d, const Step *s) {
    if (s->batch < 1 || s->batch > MAX_BATCH) return -1;
    d->step = s;
#pragma omp parallel num_threads(d->num_threads)
    {
        Worker *w = &d->workers[omp_get_thread_num()];
        w->tid = omp_get_thread_num();
        w->num_threads = omp_get_num_threads(); /* may be fewer than asked */
        forward(w);
    }
    return 0;
}

/* y [B, N] = x [B, K] times a quantized W [N, K] (rows of GGUF blocks of `type`), on one
 * thread, through the step's own kernels: the tests check them against gguf.quants.
 * scalar_kquants: K-quant dot products by the portable loop instead of AVX2. */
int64_t shoal_quantized_matmul(int64_t type, const uint8_t *blocks, int64_t N, int64_t K, const float *x, int64_t B, float *y,
                               int64_t scalar_kquants) {
    if ((type != TYPE_Q4_0 && type != TYPE_Q4_1 && type != TYPE_Q8_0 && !is_kquant(type)) || K % (is_kquant(type) ? QK_K : QK)
        || B < 1 || B > MAX_BATCH) return -1;
    Decoder *d = calloc(1, sizeof(Decoder));
    d->scalar_kquants = (int)scalar_kquants;
    Worker *w = &d->workers[0];
    w->dec = d, w->tid = 0, w->num_threads = 1;
    d->xq = calloc(QUANT_DOT_MAX_BATCH * (K / QK), sizeof(BlockQ8X));
    matvec(w, (Mat){NULL, blocks, type}, NULL, x, B, K, (N + 7) / 8 * 8, N, y, N);
    free(w->dequant), free(d->xq), free(d);
    return 0;
}

/* ---- sampling: temperature and top-p without a sort --------------------------------- */

/* the next uniform in (0, 1] after u: splitmix64 of its bits (a retry's draw, as fixed as u) */
static double next_uniform(double u) {
    uint64_t x;
    memcpy(&x, &u, sizeof x);
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return ((double)(x >> 11) + 0.5) / 9007199254740992.0;
}

/* the first token whose running sum of e reaches r (the last with e > 0 if rounding never does) */
static int64_t inverse_cdf(const float *e, int64_t V, double r) {
    double cum = 0.0;
    int64_t i = 0;
    for (; i + 8 <= V; i += 8) { /* skip whole groups of 8 */
        double g = hsum(_mm256_loadu_ps(e + i));
        if (cum + g >= r) break;
        cum += g;
    }
    for (; i < V; i++) {
        cum += e[i];
        if (cum >= r && e[i] > 0) return i;
    }
    for (int64_t j = V - 1; j > 0; j--)
        if (e[j] > 0) return j;
    return 0;
}

/* the probability mass (unnormalized) of the tokens strictly more likely than e_t */
static double mass_above(const float *e, int64_t V, float et) {
    __m256 acc = _mm256_setzero_ps(), t = _mm256_set1_ps(et);
    int64_t i = 0;
    double sum = 0.0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = _mm256_loadu_ps(e + i);
        acc = _mm256_add_ps(acc, _mm256_and_ps(_mm256_cmp_ps(v, t, _CMP_GT_OQ), v));
        if ((i & 1023) == 1016) sum += hsum(acc), acc = _mm256_setzero_ps(); /* float sums stay short */
    }
    sum += hsum(acc);
    for (; i < V; i++) sum += e[i] > et ? e[i] : 0.0f;
    return sum;
}

static int cmp_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* One row: greedy (temperature 0), or a token of softmax(x / T) restricted to the top-p nucleus
 * (the fewest most likely tokens whose mass reaches p, as a sort-and-cumsum would keep it).
 * Sampled from the full distribution and kept when the token lies inside the nucleus (the
 * mass strictly above it is below p), else drawn again: exactly the nucleus's distribution,
 * at two or three passes over the row instead of a sort. After 16 misses (p tiny against a
 * flat distribution) the row's nucleus threshold comes from a sort. */
static int64_t sample_row(const float *x, int64_t V, float temperature, float top_p, double u, float *e, float *sorted) {
    float mx = max_of(x, V);
    if (temperature <= 0.0f) {
        for (int64_t i = 0; i < V; i++)
            if (x[i] == mx) return i;
        return 0;
    }
    float inv = 1.0f / temperature;
    int64_t i = 0;
    __m256 vs = _mm256_setzero_ps(), vi = _mm256_set1_ps(inv), vm = _mm256_set1_ps(mx * inv);
    double z = 0.0;
    for (; i + 8 <= V; i += 8) {
        __m256 v = exp256(_mm256_fmsub_ps(_mm256_loadu_ps(x + i), vi, vm));
        v = _mm256_and_ps(v, _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(-INFINITY), _CMP_GT_OQ)); /* -inf: 0 */
        _mm256_storeu_ps(e + i, v);
        vs = _mm256_add_ps(vs, v);
        if ((i & 1023) == 1016) z += hsum(vs), vs = _mm256_setzero_ps();
    }
    z += hsum(vs);
    for (; i < V; i++) z += (e[i] = x[i] > -INFINITY ? expf(x[i] * inv - mx * inv) : 0.0f);
    if (top_p >= 1.0f) return inverse_cdf(e, V, u * z);
    double need = (double)top_p * z;
    for (int attempt = 0; attempt < 16; attempt++) {
        int64_t t = inverse_cdf(e, V, u * z);
        if (mass_above(e, V, e[t]) < need) return t;
        u = next_uniform(u);
    }
    if (!sorted) return inverse_cdf(e, V, u * z); /* no memory for the sort: the last draw's row */
    memcpy(sorted, e, V * sizeof(float));
    qsort(sorted, V, sizeof(float), cmp_desc);
    double before = 0.0;
    float threshold = sorted[0];
    for (int64_t j = 0; j < V && before < need; j++) threshold = sorted[j], before += sorted[j];
    double kept = 0.0;
    for (int64_t j = 0; j < V; j++) {
        if (e[j] < threshold) e[j] = 0.0f;
        kept += e[j];
    }
    return inverse_cdf(e, V, u * kept);
}

/* tokens[s] for the S rows of logits [S, V] (each row's temperature, top_p; u in (0, 1]) */
int64_t shoal_sample_top_p(const float *logits, int64_t S, int64_t V, const float *temperature, const float *top_p,
                           const double *u, int64_t *tokens, int64_t num_threads) {
    int failed = 0;
#pragma omp parallel num_threads((int)num_threads)
    {
        float *e = aligned_alloc(64, ((V * sizeof(float) + 63) / 64) * 64), *sorted = NULL;
        if (!e) failed = 1;
#pragma omp for schedule(dynamic, 4)
        for (int64_t s = 0; s < S; s++) {
            if (!e) continue;
            if (top_p[s] < 1.0f && temperature[s] > 0.0f && !sorted) sorted = malloc(V * sizeof(float));
            tokens[s] = sample_row(logits + s * V, V, temperature[s], top_p[s], u[s], e, sorted);
        }
        free(e), free(sorted);
    }
    return failed ? -1 : 0;
}

/* out[t] = silu(x[t, :I]) * x[t, I:] for T rows of a fused gate/up projection, in one pass
 * (torch's silu and mul take three over the same megabytes); the prefill path uses it. */
void shoal_silu_and_mul(const float *x, float *out, int64_t T, int64_t I, int64_t num_threads) {
#pragma omp parallel for num_threads((int)num_threads) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* ---- prefill attention over the paged cache (the torch path's, for its prefill rows) --- */

typedef struct {
    const float *q;          /* [T, h, d]: token t's heads at q + t * q_stride, each d contiguous */
    int64_t q_stride;
    const float *k_cache;    /* (block, offset, kv head, c) at block * block_stride + offset * d + head * head_stride + c */
    const float *v_cache;    /* the same strides */
    int64_t block_stride, head_stride, block_size;
    const int64_t *block_tables; /* [B, max_blocks] */
    int64_t max_blocks;
    const int64_t *query_start_loc; /* [B + 1] */
    const int64_t *context_lens;    /* [B]: the new tokens are each sequence's last */
    int64_t batch, heads, kv_heads, head_dim;
    double scale;
    float *out;              /* [T, h, d], contiguous */
} Prefill;

/* A panel of 8 keys (rows of k, d apart) transposed: panel[c][i] = key i, element c; keys
 * i >= n (past the context, or n <= 0) are zeros. Full panels go by 8x8 register transposes. */
static void transpose_keys(const float *k, int64_t n, int64_t d, float *panel) {
    if (n < 8) {
        for (int64_t c = 0; c < d; c++)
            for (int64_t i = 0; i < 8; i++) panel[c * 8 + i] = i < n ? k[i * d + c] : 0.0f;
        return;
    }
    for (int64_t c = 0; c < d; c += 8) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(k + i * d + c);
        for (int i = 0; i < 8; i += 2) {
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
            t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        }
        for (int i = 0; i < 8; i += 4) {
            r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
            r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
            r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
            r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        for (int i = 0; i < 4; i++) {
            _mm256_storeu_ps(panel + (c + i) * 8, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
            _mm256_storeu_ps(panel + (c + i + 4) * 8, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
        }
    }
}

#define PREFILL_TOKENS 16

/* Causal attention of the n_q new tokens from token t0 of sequence b (first at position pos0)
 * for the g query heads of KV head kh. Rows r = token * g + head; one pass over the key blocks
 * with an online softmax (flash attention): scores of a block are one register-tiled product of
 * the rows with the block's transposed keys, and its values are read where they lie. */
static void prefill_item(const Prefill *a, int64_t b, int64_t t0, int64_t n_q, int64_t kh, float *scratch) {
    int64_t d = a->head_dim, g = a->heads / a->kv_heads, bs = a->block_size, R = n_q * g;
    int64_t width = (bs + 15) / 16 * 16; /* a block's keys, padded to whole panel pairs */
    float *qs = scratch, *o = qs + R * d, *kt = o + R * d, *s = kt + width * d, *mx = s + R * bs, *sum = mx + R;
    float (*tmp)[16] = (float (*)[16])(sum + R);
    int64_t first = a->query_start_loc[b] + t0, pos0 = a->context_lens[b] - (a->query_start_loc[b + 1] - a->query_start_loc[b]) + t0;
    const int64_t *table = a->block_tables + b * a->max_blocks;
    float scale = (float)a->scale;
    for (int64_t r = 0; r < R; r++) {
        const float *src = a->q + (first + r / g) * a->q_stride + (kh * g + r % g) * d;
        for (int64_t c = 0; c < d; c++) qs[r * d + c] = src[c] * scale; /* scores come out scaled */
        mx[r] = -INFINITY, sum[r] = 0.0f;
    }
    memset(o, 0, R * d * sizeof(float));
    int64_t last = pos0 + n_q - 1; /* the tile's last position: no key after it is seen */
    for (int64_t blk = 0; blk * bs <= last; blk++) {
        int64_t n = last - blk * bs + 1 < bs ? last - blk * bs + 1 : bs;
        const float *kb = a->k_cache + table[blk] * a->block_stride + kh * a->head_stride;
        const float *vb = a->v_cache + table[blk] * a->block_stride + kh * a->head_stride;
        for (int64_t p = 0; p < width / 8; p++) transpose_keys(kb + 8 * p * d, n - 8 * p, d, kt + p * d * 8);
        for (int64_t pp = 0; pp * 16 < n; pp++) { /* s [R, n] = q k^T, 16 keys at a time */
            tile_rows(kt + 2 * pp * 8 * d, kt + (2 * pp + 1) * 8 * d, 8, qs, R, d, 2, tmp);
            int64_t cols = n - 16 * pp < 16 ? n - 16 * pp : 16;
            for (int64_t r = 0; r < R; r++) memcpy(s + r * n + 16 * pp, tmp[r], cols * sizeof(float));
        }
        for (int64_t r = 0; r < R; r++) { /* online softmax over the keys row r sees */
            float *p = s + r * n;
            int64_t seen = pos0 + r / g - blk * bs + 1;
            seen = seen < n ? seen : n;
            if (seen <= 0) {
                memset(p, 0, n * sizeof(float));
                continue;
            }
            float block_max = max_of(p, seen), m = block_max > mx[r] ? block_max : mx[r];
            if (m > mx[r]) {
                float alpha = expf(mx[r] - m);
                sum[r] *= alpha;
                for (int64_t c = 0; c < d; c++) o[r * d + c] *= alpha;
                mx[r] = m;
            }
            sum[r] = exp_shifted(p, seen, m, sum[r]);
            for (int64_t t = seen; t < n; t++) p[t] = 0.0f;
        }
        for (int64_t c = 0; c < d; c += 16) { /* o += s v, 16 columns of the values at a time */
            int two = c + 8 < d;
            tile_rows(vb + c, vb + c + 8, d, s, R, n, two ? 2 : 1, tmp);
            for (int64_t r = 0; r < R; r++)
                for (int64_t i = 0; i < (two ? 16 : 8); i++) o[r * d + c + i] += tmp[r][i];
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *dst = a->out + (first + r / g) * a->heads * d + (kh * g + r % g) * d, inv = 1.0f / sum[r];
        for (int64_t c = 0; c < d; c++) dst[c] = o[r * d + c] * inv;
    }
}

/* Floats of scratch prefill_item needs. */
static int64_t prefill_scratch(const Prefill *a) {
    int64_t d = a->head_dim, R = PREFILL_TOKENS * (a->heads / a->kv_heads), width = (a->block_size + 15) / 16 * 16;
    return 2 * R * d + width * d + R * a->block_size + 2 * R + 16 * R;
}

/* All prefill rows of a step: items of (sequence, 16 new tokens, KV head), shared out
 * dynamically (later tokens see more keys). Returns 0, or -1 when out of memory. */
int64_t shoal_prefill_attention(const Prefill *a, int64_t num_threads) {
    typedef struct { int64_t seq, t0, kv_head; } Item;
    int64_t items = 0, kvh = a->kv_heads;
    for (int64_t b = 0; b < a->batch; b++)
        items += (a->query_start_loc[b + 1] - a->query_start_loc[b] + PREFILL_TOKENS - 1) / PREFILL_TOKENS * kvh;
    Item *work = malloc((items ? items : 1) * sizeof(Item)), *next = work;
    if (!work) return -1;
    for (int64_t b = 0; b < a->batch; b++)
        for (int64_t kh = 0; kh < kvh; kh++) /* a head's tiles in a row: the threads share its keys in cache */
            for (int64_t t0 = 0; t0 < a->query_start_loc[b + 1] - a->query_start_loc[b]; t0 += PREFILL_TOKENS)
                *next++ = (Item){b, t0, kh};
    int64_t failed = 0;
#pragma omp parallel num_threads((int)num_threads)
    {
        float *scratch = aligned_alloc(64, (prefill_scratch(a) * sizeof(float) + 63) / 64 * 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < items; it++) {
            if (!scratch) continue;
            Item w = work[it];
            int64_t left = a->query_start_loc[w.seq + 1] - a->query_start_loc[w.seq] - w.t0;
            prefill_item(a, w.seq, w.t0, left < PREFILL_TOKENS ? left : PREFILL_TOKENS, w.kv_head, scratch);
        }
        free(scratch);
    }
    free(work);
    return failed ? -1 : 0;
}

void shoal_decoder_free(Decoder *d) {
    for (int t = 0; t < MAX_THREADS; t++) free(d->workers[t].scores), free(d->workers[t].dequant), free(d->workers[t].rows);
    Moe *g = &d->moe;
    free(g->logits); free(g->weight); free(g->expert); free(g->pair_token); free(g->pair_of);
    free(g->count); free(g->start); free(g->active); free(g->act); free(g->y); free(g->shared_act); free(g->shared_y);
    free(d->xq);
    free(d->resid); free(d->normed); free(d->out); free(d->qkv); free(d->attn); free(d->act);
    free(d);
}
