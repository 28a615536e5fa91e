/* OTAS's Alg. 2 dynamic program, every stage and the back-tracking in one call: the native form of
 * jaxserve.sched.otas.solve_token_dp (see there and the module docstring for what it decides).
 *
 * Contract: the same labels as the Python/numpy stages, to the bit. A label is (clock, neg), neg the
 * negated utility. Per stage the candidates are every label of the previous frontier unchanged ("skip",
 * column 0) and, per undominated option j (column j >= 1), label + (seconds_j / executors, -utility_j)
 * where clock + seconds_j < deadline (executors = 1: the paper's one sequential executor; m > 1: the
 * clock of m executors sharing the work, see jaxserve.sched.otas); they are visited in (clock, neg,
 * parent, column) order, and a candidate is kept iff neg < last kept neg and, unless it is the first, last - neg > 1e-9 * max(1, |neg|, |last|);
 * a frontier above max_labels keeps positions round(i * (K - 1) / (max_labels - 1)) (half to even).
 * Only IEEE double additions, subtractions, one multiplication, one division per option and
 * comparisons, in the order Python evaluates them: it must be compiled without fast-math and without FMA contraction.
 *
 * How, without sorting: a frontier has strictly increasing clocks and strictly decreasing negs, so each
 * column is ordered by clock (non-decreasing) with negs non-increasing. A candidate whose neg is not
 * below the last kept one can never be kept (the last kept neg only falls), and in a column those form
 * a prefix of what is left; so each column keeps a head past that prefix, and the next candidate in the
 * order is the least head by (clock, neg, parent, column). Where rounding gives a column two equal
 * clocks at its head (the head would then not be the column's least candidate) the stage is redone by
 * writing out every candidate, each column put in full-key order (only its runs of equal clocks move),
 * and merging the columns (stage_merged). `general` forces a plain qsort of every candidate by the full
 * key instead (stage_sorted), for the tests: the order both give.
 *
 * The caller guarantees no NaN can arise (start not NaN, every option finite). A candidate whose neg
 * overflows to an infinity returns OTAS_DP_NONFINITE: the numpy stage's near-tie shortcuts and the
 * Python stage's rule may part there, so the caller runs its own stages instead.
 */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if FLT_EVAL_METHOD != 0
#error "doubles must be evaluated as doubles (no excess precision) to match numpy to the bit"
#endif

#define OTAS_DP_OK 0
#define OTAS_DP_NONFINITE 1
#define OTAS_DP_NOMEM 2
#define OTAS_DP_RUN 3 /* internal: the fast stage met equal clocks at a column head */

typedef struct {
    double clock, neg;
    int64_t parent, column;
} cand_t;

/* Scratch kept per thread from call to call: a DP call is a few hundred kilobytes of labels and links,
 * which malloc would otherwise hand back to the system and fault in again on every call. */
typedef struct {
    void *data;
    size_t bytes;
} buf_t;

#define KEEP_BYTES ((size_t)16 << 20) /* larger scratch is freed when the call ends */

static int reserve(buf_t *b, size_t n, size_t size) {
    if (n * size <= b->bytes) return 0;
    size_t bytes = b->bytes ? b->bytes : 1024;
    while (bytes < n * size) bytes *= 2;
    void *p = realloc(b->data, bytes);
    if (!p) return -1;
    b->data = p;
    b->bytes = bytes;
    return 0;
}

static void release_large(buf_t *b) {
    if (b->bytes > KEEP_BYTES) {
        free(b->data);
        b->data = NULL;
        b->bytes = 0;
    }
}

/* Python's rule: keep iff n < last and (first, or last - n > 1e-9 * max(1.0, abs(n), abs(last))). */
static inline int keeps(double n, double last, int first) {
    if (!(n < last)) return 0;
    if (first) return 1;
    double m = 1.0, an = fabs(n), al = fabs(last);
    if (an > m) m = an;
    if (al > m) m = al;
    return last - n > 1e-9 * m;
}

/* Python's round() of a non-negative double: to nearest, halves to even. */
static inline int64_t round_half_even(double x) {
    double f = floor(x);
    double frac = x - f; /* exact */
    int64_t r = (int64_t)f;
    if (frac > 0.5 || (frac == 0.5 && (r & 1))) r++;
    return r;
}

static int cand_cmp(const void *a, const void *b) {
    const cand_t *x = a, *y = b;
    if (x->clock < y->clock) return -1;
    if (x->clock > y->clock) return 1;
    if (x->neg < y->neg) return -1;
    if (x->neg > y->neg) return 1;
    if (x->parent != y->parent) return x->parent < y->parent ? -1 : 1;
    return (x->column > y->column) - (x->column < y->column);
}

typedef struct {
    const double *fc, *fn; /* frontier */
    int64_t n_labels;
    const double *seconds, *gains; /* per column */
    const int64_t *end;            /* per column: candidates are parents [0, end) */
    int64_t width;
} stage_t;

/* Column 0 (skip) has seconds -0.0 and gain +0.0: x + -0.0 and x - 0.0 are x for every x, -0.0 included. */
#define CLOCK(st, p, j) ((st)->fc[p] + (st)->seconds[j])
#define NEG(st, p, j) ((st)->fn[p] - (st)->gains[j])

/* Whether candidate (c1, n1, p1, j1) comes before (c2, n2, p2, j2): (clock, neg, parent, column). */
static inline int before(double c1, double n1, int64_t p1, int64_t j1, double c2, double n2, int64_t p2, int64_t j2) {
    if (c1 != c2) return c1 < c2;
    if (n1 != n2) return n1 < n2;
    return p1 != p2 ? p1 < p2 : j1 < j2;
}

/* One column of the fast stage: its step, its end and its head (the head's parent, clock and neg). */
typedef struct {
    double s, g, c, n;
    int64_t end, p;
} column_t;

/* The kept candidates in order into out (capacity >= n_labels * width): their count, or -OTAS_DP_RUN.
 * A head is checked against the next label of its column: a clock equal to the next one's returns
 * -OTAS_DP_RUN, so a head's key is below every key left in its column. */
static int64_t stage_fast(const stage_t *st, cand_t *restrict out, column_t *restrict col) {
    const int64_t w = st->width;
    const double *restrict fc = st->fc, *restrict fn = st->fn;
    int64_t kept = 0;
    double last = INFINITY;
    for (int64_t j = 0; j < w; j++) {
        column_t *k = &col[j];
        k->s = st->seconds[j];
        k->g = st->gains[j];
        k->end = st->end[j];
        k->p = 0;
        if (k->end > 0) {
            k->c = fc[0] + k->s;
            k->n = fn[0] - k->g;
            if (k->end > 1 && fc[1] + k->s == k->c) return -OTAS_DP_RUN;
        }
    }
    for (;;) {
        /* every head past the candidates that can no longer be kept, and the least head */
        int64_t bj = -1;
        double bc = 0.0, bn = 0.0;
        int64_t bp = 0;
        for (int64_t j = 0; j < w; j++) {
            column_t *k = &col[j];
            int64_t p = k->p;
            const int64_t end = k->end;
            if (p >= end) continue;
            if (!(k->n < last)) { /* negs descend in a column: the ones not below last are a prefix */
                const double g = k->g;
                p++;
                while (p < end && !(fn[p] - g < last)) p++;
                k->p = p;
                if (p >= end) continue;
                k->c = fc[p] + k->s;
                k->n = fn[p] - g;
                if (p + 1 < end && fc[p + 1] + k->s == k->c) return -OTAS_DP_RUN;
            }
            if (bj < 0 || before(k->c, k->n, p, j, bc, bn, bp, bj)) {
                bj = j;
                bc = k->c;
                bn = k->n;
                bp = p;
            }
        }
        if (bj < 0) break;
        if (keeps(bn, last, kept == 0)) {
            out[kept].clock = bc;
            out[kept].neg = bn;
            out[kept].parent = bp;
            out[kept].column = bj;
            kept++;
            last = bn;
        }
        column_t *k = &col[bj];
        const int64_t p = ++k->p;
        if (p < k->end) {
            k->c = fc[p] + k->s;
            k->n = fn[p] - k->g;
            if (p + 1 < k->end && fc[p + 1] + k->s == k->c) return -OTAS_DP_RUN;
        }
    }
    return kept;
}

/* The same by sorting every candidate; all (capacity >= n_labels * width) is scratch. */
static int64_t stage_sorted(const stage_t *st, cand_t *out, cand_t *all) {
    int64_t n = 0;
    for (int64_t j = 0; j < st->width; j++)
        for (int64_t p = 0; p < st->end[j]; p++) {
            all[n].clock = CLOCK(st, p, j);
            all[n].neg = NEG(st, p, j);
            all[n].parent = p;
            all[n].column = j;
            n++;
        }
    qsort(all, (size_t)n, sizeof(cand_t), cand_cmp);
    int64_t kept = 0;
    double last = INFINITY;
    for (int64_t i = 0; i < n; i++)
        if (keeps(all[i].neg, last, kept == 0)) {
            out[kept++] = all[i];
            last = all[i].neg;
        }
    return kept;
}

/* The same by merging the columns, for a stage the fast one hands back (equal clocks at a head): each
 * column's candidates are written in parent order, which is clock order but for runs of equal clocks
 * (rounding); an insertion sort by the full key puts those runs in order, which moves nothing else, and
 * the sorted columns are merged by the full key. The full key orders every candidate apart (parent and
 * column are unique), so this is the order qsort gives, in O(candidates x columns). all (capacity >=
 * n_labels * width) and cut (2 * width) are scratch. */
static int64_t stage_merged(const stage_t *st, cand_t *restrict out, cand_t *restrict all, int64_t *restrict cut) {
    const int64_t w = st->width;
    int64_t n = 0;
    for (int64_t j = 0; j < w; j++) {
        const int64_t first = n;
        cut[2 * j] = first;
        for (int64_t p = 0; p < st->end[j]; p++) {
            cand_t c = {CLOCK(st, p, j), NEG(st, p, j), p, j};
            int64_t at = n++;
            while (at > first && cand_cmp(&all[at - 1], &c) > 0) {
                all[at] = all[at - 1];
                at--;
            }
            all[at] = c;
        }
        cut[2 * j + 1] = n;
    }
    int64_t kept = 0;
    double last = INFINITY;
    for (;;) {
        int64_t bj = -1;
        for (int64_t j = 0; j < w; j++)
            if (cut[2 * j] < cut[2 * j + 1] && (bj < 0 || cand_cmp(&all[cut[2 * j]], &all[cut[2 * bj]]) < 0)) bj = j;
        if (bj < 0) break;
        const cand_t *c = &all[cut[2 * bj]++];
        if (keeps(c->neg, last, kept == 0)) {
            out[kept++] = *c;
            last = c->neg;
        }
    }
    return kept;
}

/* Alg. 2 over n_stages batches. records: per stage, its option count m (as a double), then m pairs
 * (seconds, utility) of its undominated options in column order. executors: what a label's clock
 * advances by is seconds / executors (x / 1.0 == x: one executor is the plain DP). Out: columns[b]
 * (0: not executed, j: the j-th undominated option), result = (clock, neg) of the best final label,
 * widest (labels of the widest frontier, at least 1), truncated (a frontier was thinned). general:
 * always sort (tests).
 * Returns OTAS_DP_OK, OTAS_DP_NONFINITE (nothing meaningful written) or OTAS_DP_NOMEM. */
int64_t jaxserve_otas_dp(int64_t n_stages, const double *deadlines, const double *records, double start,
                         double executors, int64_t max_labels, int64_t general, int32_t *columns, double *result,
                         int64_t *widest_out, int64_t *truncated_out) {
    static _Thread_local buf_t fc, fn, kept, scratch, cuts, link_parent, link_column, link_at, per_column;
    int64_t rc = OTAS_DP_NOMEM, n_labels = 1, widest = 1, truncated = 0, links = 0;
    if (reserve(&fc, 1, sizeof(double)) || reserve(&fn, 1, sizeof(double)) ||
        reserve(&link_at, (size_t)n_stages + 1, sizeof(int64_t)))
        goto done;
    ((double *)fc.data)[0] = start;
    ((double *)fn.data)[0] = -0.0;
    const double *rec = records;
    for (int64_t b = 0; b < n_stages; b++) {
        const int64_t m = (int64_t)rec[0], w = m + 1;
        const double deadline = deadlines[b];
        const double *fcs = fc.data, *fns = fn.data;
        /* per column: seconds, gains, end; then the fast stage's columns */
        if (reserve(&per_column, (size_t)w * (3 + sizeof(column_t) / 8), 8)) goto done;
        double *seconds = per_column.data, *gains = seconds + w;
        int64_t *end = (int64_t *)(gains + w);
        column_t *cols = (column_t *)(end + w);
        seconds[0] = -0.0;
        gains[0] = 0.0;
        end[0] = n_labels;
        for (int64_t j = 1; j < w; j++) {
            seconds[j] = rec[2 * j - 1];
            gains[j] = rec[2 * j];
            /* clocks ascend, so do the finishes: the labels that fit are a prefix */
            int64_t lo = 0, hi = n_labels;
            while (lo < hi) {
                int64_t mid = lo + (hi - lo) / 2;
                if (fcs[mid] + seconds[j] < deadline) lo = mid + 1;
                else hi = mid;
            }
            end[j] = lo;
            /* negs descend: the first and last that fit bound every one between */
            if (lo > 0 && !(isfinite(fns[0] - gains[j]) && isfinite(fns[lo - 1] - gains[j]))) {
                rc = OTAS_DP_NONFINITE;
                goto done;
            }
        }
        /* a label's clock advances by the option's share of the executors' time; the fit test above
         * used the whole time (a batch runs on one executor), and a prefix still fits: x / e is monotone */
        for (int64_t j = 1; j < w; j++) seconds[j] = seconds[j] / executors;
        rec += 1 + 2 * m;
        const size_t most = (size_t)n_labels * (size_t)w;
        if (reserve(&kept, most, sizeof(cand_t))) goto done;
        stage_t st = {fcs, fns, n_labels, seconds, gains, end, w};
        int64_t k = general ? -OTAS_DP_RUN : stage_fast(&st, kept.data, cols);
        if (k < 0) {
            if (reserve(&scratch, most, sizeof(cand_t)) || reserve(&cuts, (size_t)(2 * w), sizeof(int64_t))) goto done;
            k = general ? stage_sorted(&st, kept.data, scratch.data) : stage_merged(&st, kept.data, scratch.data, cuts.data);
        }
        const cand_t *kc = kept.data;
        const int thin = k > max_labels;
        const int64_t size = thin ? max_labels : k;
        if (reserve(&link_parent, (size_t)(links + size), sizeof(int64_t)) ||
            reserve(&link_column, (size_t)(links + size), sizeof(int32_t)) ||
            reserve(&fc, (size_t)size, sizeof(double)) || reserve(&fn, (size_t)size, sizeof(double)))
            goto done;
        double *nc = fc.data, *nn = fn.data; /* the old frontier is no longer read: kept holds its parts */
        int64_t *lp = (int64_t *)link_parent.data + links;
        int32_t *lj = (int32_t *)link_column.data + links;
        const double step = thin ? (double)(k - 1) / (double)(max_labels - 1) : 0.0;
        for (int64_t i = 0; i < size; i++) {
            const int64_t at = thin ? round_half_even((double)i * step) : i;
            nc[i] = kc[at].clock;
            nn[i] = kc[at].neg;
            lp[i] = kc[at].parent;
            lj[i] = (int32_t)kc[at].column;
        }
        ((int64_t *)link_at.data)[b] = links;
        links += size;
        n_labels = size;
        truncated |= thin;
        if (n_labels > widest) widest = n_labels;
    }
    {
        int64_t index = n_labels - 1; /* the last label: the best utility, the earliest among ties */
        result[0] = ((double *)fc.data)[index];
        result[1] = ((double *)fn.data)[index];
        for (int64_t b = n_stages - 1; b >= 0; b--) {
            const int64_t at = ((int64_t *)link_at.data)[b] + index;
            columns[b] = ((int32_t *)link_column.data)[at];
            index = ((int64_t *)link_parent.data)[at];
        }
    }
    *widest_out = widest;
    *truncated_out = truncated;
    rc = OTAS_DP_OK;
done:
    release_large(&fc);
    release_large(&fn);
    release_large(&kept);
    release_large(&scratch);
    release_large(&cuts);
    release_large(&link_parent);
    release_large(&link_column);
    release_large(&link_at);
    release_large(&per_column);
    return rc;
}
