// The CPU kernels of fastprompt.ops.contrastive_loss: in-batch cosine InfoNCE over streamed tiles, O(N·d) memory.
//
// One *problem* (fastprompt/ops/contrastive.py builds it; the symmetric loss is two problems): rows x (n, d)
// against column segments, the targets block (m0 rows; row i's target is its row label_offset + i) and optionally
// the negatives block (k·m0 rows; row i's own negatives are its rows j·m0 + label_offset + i). Per Matryoshka
// dimension d_t (ascending; one dimension = all of d) the cosines are those of the d_t-prefixes, from the inverse
// prefix norms the caller passes ((D, rows) each), and
//   logit = cos · (inv_tau + a_in)                 an in-batch negative (a_in: its hardness penalty)
//         = cos · (inv_tau + a_own) + bias_own     one of the row's own negatives
//         = cos · inv_tau                          the target
//         = -inf                                   a column left out of the row's softmax (a false negative):
//                                                  equal text id (ids[col] == tid[row]) or no text (ids < 0), a
//                                                  guide cosine > thr[0][row] (gx given), or, scored by the model,
//                                                  cos > thr[t][row]; never the target.
// The hardness penalty is a constant of the softmax (no gradient): d logit / d cos = inv_tau everywhere.
//
// The N x M matrix is never stored: row blocks (parallel) stream column tiles whose products run at BLAS speed
// on the raw rows (at::mm_out / addmm_; the normalisation is a scaling of each tile by the inverse norms). The
// Matryoshka prefixes share one sweep over d: the tile of prefix t is the tile of prefix t - 1 plus the product
// of the columns d_{t-1}..d_t, so D dimensions cost the products of one.
//
// Entry points (torch.ops.fastprompt.*):
// - contrastive_cpu_stats: per row and dimension the log-sum-exp (online over the tiles), the target's cosine and
//   the hardest negative (largest cosine over the columns left in the softmax other than the target; ties keep
//   the lowest column; -inf / -1 when none is left);
// - contrastive_cpu_grads: for per-row normalisers L and coefficients (cce, cdiag, chg), with
//   dS = cce · exp(logit - L) - cdiag · [target] + chg · [hardest], the gradients in *raw space*: E = Σ_t Σ_j
//   dS^t_ij r^t_i r^t_j z_j[:d_t] for rows and columns alike, and Q^t = Σ_j dS^t_ij cos^t_ij; the caller finishes
//   dz = E - Σ_t (r^t)² Q^t z[:d_t] (the normalisation's projection; fastprompt/ops/contrastive.py). Per tile the
//   coefficient tiles X^t = dS^t ∘ r^t r^t are summed from the largest prefix down (W^t = Σ_{u >= t} X^u), and the
//   chunk d_{t-1}..d_t of the gradient takes W^t: again the products of one dimension. Rows and column tiles go in
//   groups processed in rounds (round r: thread t owns row group t and column group t + r, a Latin square), so
//   nothing is written twice at once: no atomics, deterministic for a given thread count (4 products per tile with
//   the forward);
// - contrastive_cpu_fused: both in one pass for a uniform upstream gradient (training: reductions mean / sum), from
//   the stripe of every column of a row block (≤ 16 MiB per thread): 3 products per tile, as many as the
//   materialising reference. Falls back to stats + grads when a 16-row stripe does not fit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace fastprompt {
namespace {

constexpr int64_t kRowBlock = 128;
constexpr int64_t kColTile = 256;
constexpr int64_t kStripeElems = int64_t(1) << 22;  // per-thread budget of the fused pass's buffers (16 MiB fp32)
constexpr int64_t kMinStripeRows = 16;
constexpr int64_t kMaxStripeRows = 256;

using OptTensorList = c10::List<c10::optional<at::Tensor>>;

struct Segment {
  at::Tensor z;    // (rows, d), contiguous
  at::Tensor r;    // (D, rows) inverse norms of the prefixes
  at::Tensor ids;  // (rows,) int64 text ids, or undefined
  at::Tensor g;    // (rows, dg) unit guide vectors, or undefined
  int64_t base;    // global index of its first column
  bool negatives;  // the negatives block (own columns j·m0 + label), else the targets block
  int64_t size() const { return z.size(0); }
};

struct Problem {
  at::Tensor x, rx;  // rows (n, d) and their inverse prefix norms (D, n)
  std::vector<Segment> segs;
  at::Tensor tid;  // (n,) text id of each row's target, or undefined
  at::Tensor gx;   // (n, dg) unit guide vectors of the rows, or undefined
  at::Tensor thr;  // (D or 1, n) false-negative thresholds, or undefined
  std::vector<int64_t> dims;
  int64_t n = 0, d = 0, m = 0, m0 = 0, label_offset = 0;
  double inv_tau = 1.0, bias_own = 0.0, a_in = 0.0, a_own = 0.0;

  int64_t ndims() const { return static_cast<int64_t>(dims.size()); }
  bool static_mask() const { return tid.defined() || gx.defined(); }
  bool model_margin() const { return thr.defined() && !gx.defined(); }
  int64_t label(int64_t row) const { return label_offset + row; }
  at::TensorOptions opts() const { return x.options(); }
};

Problem make_problem(const at::Tensor& x, const at::Tensor& rx, at::TensorList cols, at::TensorList rcols,
                     at::IntArrayRef dims, const c10::optional<at::Tensor>& tid, const OptTensorList& col_ids,
                     const c10::optional<at::Tensor>& gx, const OptTensorList& gcols,
                     const c10::optional<at::Tensor>& thr, int64_t label_offset, double inv_tau, double bias_own,
                     double a_in, double a_own) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "contrastive_cpu: rows must be a 2-D CPU tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "contrastive_cpu: float32 or float64 inputs expected");
  TORCH_CHECK(cols.size() == 1 || cols.size() == 2, "contrastive_cpu: one or two column segments expected");
  TORCH_CHECK(rcols.size() == cols.size() && col_ids.size() == cols.size() && gcols.size() == cols.size(),
              "contrastive_cpu: one norm / id / guide entry per column segment expected");
  TORCH_CHECK(!dims.empty(), "contrastive_cpu: at least one dimension expected");
  Problem p;
  p.x = x.contiguous();
  p.n = x.size(0);
  p.d = x.size(1);
  p.dims.assign(dims.begin(), dims.end());
  for (size_t t = 0; t < p.dims.size(); ++t) {
    TORCH_CHECK(p.dims[t] > (t ? p.dims[t - 1] : 0) && p.dims[t] <= p.d,
                "contrastive_cpu: dims must be increasing and within the embedding size");
  }
  const int64_t D = p.ndims();
  auto check_norms = [&](const at::Tensor& r, int64_t rows) {
    TORCH_CHECK(r.dim() == 2 && r.size(0) == D && r.size(1) == rows && r.scalar_type() == x.scalar_type(),
                "contrastive_cpu: inverse norms must be (len(dims), rows) in the rows' dtype");
    return r.contiguous();
  };
  p.rx = check_norms(rx, p.n);
  p.m0 = cols[0].size(0);
  TORCH_CHECK(label_offset >= 0 && label_offset + p.n <= p.m0, "contrastive_cpu: targets out of range");
  p.label_offset = label_offset;
  const bool with_ids = tid.has_value(), with_guide = gx.has_value();
  if (with_ids) {
    TORCH_CHECK(tid->scalar_type() == at::kLong && tid->numel() == p.n, "contrastive_cpu: tid must be (n,) int64");
    p.tid = tid->contiguous();
  }
  if (with_guide) {
    TORCH_CHECK(gx->dim() == 2 && gx->size(0) == p.n && gx->scalar_type() == x.scalar_type(),
                "contrastive_cpu: guide rows must be (n, dg) in the rows' dtype");
    TORCH_CHECK(thr.has_value(), "contrastive_cpu: a guide needs thresholds");
    p.gx = gx->contiguous();
  }
  if (thr.has_value()) {
    TORCH_CHECK(thr->dim() == 2 && thr->size(0) == (with_guide ? 1 : D) && thr->size(1) == p.n &&
                    thr->scalar_type() == x.scalar_type(),
                "contrastive_cpu: thresholds must be (1 with a guide, else len(dims), n)");
    p.thr = thr->contiguous();
  }
  int64_t base = 0;
  for (size_t s = 0; s < cols.size(); ++s) {
    Segment seg;
    seg.z = cols[s].contiguous();
    TORCH_CHECK(seg.z.dim() == 2 && seg.z.size(1) == p.d && seg.z.scalar_type() == x.scalar_type(),
                "contrastive_cpu: columns must be (rows, d) in the rows' dtype");
    seg.r = check_norms(rcols[s], seg.size());
    seg.base = base;
    seg.negatives = s == 1;
    TORCH_CHECK(!seg.negatives || (p.m0 > 0 && seg.size() % p.m0 == 0),
                "contrastive_cpu: the negatives block must hold k·m0 rows");
    const c10::optional<at::Tensor> ids = col_ids.get(s), g = gcols.get(s);
    TORCH_CHECK(ids.has_value() == with_ids, "contrastive_cpu: text ids for every segment, or for none");
    TORCH_CHECK(g.has_value() == with_guide, "contrastive_cpu: guide vectors for every segment, or for none");
    if (with_ids) {
      TORCH_CHECK(ids->scalar_type() == at::kLong && ids->numel() == seg.size(), "contrastive_cpu: bad column ids");
      seg.ids = ids->contiguous();
    }
    if (with_guide) {
      TORCH_CHECK(g->dim() == 2 && g->size(0) == seg.size() && g->size(1) == p.gx.size(1) &&
                      g->scalar_type() == x.scalar_type(),
                  "contrastive_cpu: guide columns must be (rows, dg) like the guide rows");
      seg.g = g->contiguous();
    }
    base += seg.size();
    p.segs.push_back(seg);
  }
  p.m = base;
  p.inv_tau = inv_tau;
  p.bias_own = bias_own;
  p.a_in = a_in;
  p.a_own = a_own;
  return p;
}

// A run of columns of one segment, at column `off` of a tile buffer.
struct Part {
  const Segment* seg;
  int64_t begin, end, off;
  int64_t size() const { return end - begin; }
};

// The tiles of the streaming passes: kColTile columns of one segment each.
std::vector<std::vector<Part>> column_tiles(const Problem& p) {
  std::vector<std::vector<Part>> tiles;
  for (const Segment& seg : p.segs) {
    for (int64_t b = 0; b < seg.size(); b += kColTile) tiles.push_back({{&seg, b, std::min(b + kColTile, seg.size()), 0}});
  }
  return tiles;
}

// Every column, in global order: the stripe of the fused pass.
std::vector<Part> all_columns(const Problem& p) {
  std::vector<Part> parts;
  for (const Segment& seg : p.segs) parts.push_back({&seg, 0, seg.size(), seg.base});
  return parts;
}

int64_t width(const std::vector<Part>& parts) {
  int64_t w = 0;
  for (const Part& q : parts) w = std::max(w, q.off + q.size());
  return w;
}

int64_t global_column(const std::vector<Part>& parts, int64_t c) {
  for (const Part& q : parts) {
    if (c >= q.off && c < q.off + q.size()) return q.seg->base + q.begin + (c - q.off);
  }
  return -1;
}

at::Tensor view2d(const at::Tensor& flat, int64_t rows, int64_t cols) {
  return flat.narrow(0, 0, rows * cols).view({rows, cols});
}

// Per-thread buffers of one tile (or stripe): D cosine tiles, a scratch tile, two masks.
struct Buffers {
  at::Tensor cos, scratch, smask, dmask;
  int64_t capacity = 0;
  Buffers() = default;
  Buffers(const Problem& p, int64_t capacity) : capacity(capacity) {
    cos = at::empty({p.ndims(), capacity}, p.opts());
    scratch = at::empty({capacity}, p.opts());
    if (p.static_mask() || p.model_margin()) {
      smask = at::empty({capacity}, p.opts().dtype(at::kBool));
      dmask = at::empty({capacity}, p.opts().dtype(at::kBool));
    }
  }
};

// One tile's cosines (all dimensions) and static mask.
struct Tile {
  int64_t r0 = 0, nr = 0, nc = 0;
  std::vector<Part> parts;
  std::vector<at::Tensor> cos;  // (nr, nc) per dimension
  at::Tensor smask;             // (nr, nc) bool, or undefined
};

template <typename F>
void for_each_target(const Problem& p, const Tile& t, const F& f) {  // f(row in tile, column in tile)
  for (const Part& q : t.parts) {
    if (q.seg->negatives) continue;
    for (int64_t i = 0; i < t.nr; ++i) {
      const int64_t l = p.label(t.r0 + i);
      if (l >= q.begin && l < q.end) f(i, q.off + l - q.begin);
    }
  }
}

template <typename F>
void for_each_own_negative(const Problem& p, const Tile& t, const F& f) {
  for (const Part& q : t.parts) {
    if (!q.seg->negatives) continue;
    const int64_t k = q.seg->size() / p.m0;
    for (int64_t i = 0; i < t.nr; ++i) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t c = j * p.m0 + p.label(t.r0 + i);
        if (c >= q.begin && c < q.end) f(i, q.off + c - q.begin);
      }
    }
  }
}

template <typename scalar_t>
void clear_targets(const Problem& p, const Tile& t, at::Tensor& mask) {
  bool* mp = mask.data_ptr<bool>();
  for_each_target(p, t, [&](int64_t i, int64_t c) { mp[i * t.nc + c] = false; });
}

// The inverse norms of the tile's columns at dimension u, in the tile's column order.
template <typename scalar_t>
std::vector<scalar_t> column_norms(const Problem& p, const Tile& t, int64_t u) {
  std::vector<scalar_t> rc(t.nc, scalar_t(0));
  for (const Part& q : t.parts) {
    const scalar_t* r = q.seg->r[u].data_ptr<scalar_t>() + q.begin;
    std::copy(r, r + q.size(), rc.begin() + q.off);
  }
  return rc;
}

// The cosines of rows r0..r0+nr with the tile's columns, for every prefix (one sweep over d), and the columns
// that are left out at every dimension (text ids, guide).
template <typename scalar_t>
Tile make_tile(const Problem& p, int64_t r0, int64_t nr, std::vector<Part> parts, Buffers& b) {
  Tile t;
  t.r0 = r0;
  t.nr = nr;
  t.nc = width(parts);
  t.parts = std::move(parts);
  const at::Tensor xs = p.x.narrow(0, r0, nr);
  for (int64_t u = 0; u < p.ndims(); ++u) t.cos.push_back(view2d(b.cos[u], nr, t.nc));
  for (const Part& q : t.parts) {
    int64_t k0 = 0;
    for (int64_t u = 0; u < p.ndims(); ++u) {
      const int64_t k1 = p.dims[u];
      at::Tensor out = t.cos[u].narrow(1, q.off, q.size());
      const at::Tensor zt = q.seg->z.narrow(0, q.begin, q.size()).narrow(1, k0, k1 - k0).t();
      if (u == 0) {
        at::mm_out(out, xs.narrow(1, 0, k1), zt);
      } else {
        out.copy_(t.cos[u - 1].narrow(1, q.off, q.size()));
        out.addmm_(xs.narrow(1, k0, k1 - k0), zt);
      }
      k0 = k1;
    }
  }
  for (int64_t u = 0; u < p.ndims(); ++u) {  // raw products -> cosines, one pass
    const std::vector<scalar_t> rc = column_norms<scalar_t>(p, t, u);
    const scalar_t* rx = p.rx[u].data_ptr<scalar_t>() + r0;
    scalar_t* c = t.cos[u].data_ptr<scalar_t>();
    for (int64_t i = 0; i < nr; ++i) {
      scalar_t* ci = c + i * t.nc;
      const scalar_t ri = rx[i];
#pragma omp simd
      for (int64_t j = 0; j < t.nc; ++j) ci[j] *= ri * rc[j];
    }
  }
  if (p.static_mask()) {
    t.smask = view2d(b.smask, nr, t.nc);
    t.smask.zero_();
    for (const Part& q : t.parts) {
      at::Tensor sm = t.smask.narrow(1, q.off, q.size());
      if (p.tid.defined()) {
        const at::Tensor ids = q.seg->ids.narrow(0, q.begin, q.size());
        sm.logical_or_(ids.unsqueeze(0).eq(p.tid.narrow(0, r0, nr).unsqueeze(1)));
        sm.logical_or_(ids.lt(0).unsqueeze(0));
      }
      if (p.gx.defined()) {
        const at::Tensor gcos = at::mm(p.gx.narrow(0, r0, nr), q.seg->g.narrow(0, q.begin, q.size()).t());
        sm.logical_or_(gcos.gt(p.thr[0].narrow(0, r0, nr).unsqueeze(1)));
      }
    }
    clear_targets<scalar_t>(p, t, t.smask);
  }
  return t;
}

// The columns left out of the softmax at dimension u (undefined: none).
template <typename scalar_t>
at::Tensor dim_mask(const Problem& p, const Tile& t, int64_t u, Buffers& b) {
  if (!p.model_margin()) return t.smask;
  at::Tensor dm = view2d(b.dmask, t.nr, t.nc);
  at::gt_out(dm, t.cos[u], p.thr[u].narrow(0, t.r0, t.nr).unsqueeze(1));
  if (t.smask.defined()) dm.logical_or_(t.smask);
  clear_targets<scalar_t>(p, t, dm);
  return dm;
}

// The logits of dimension u into `out`.
template <typename scalar_t>
void logit_tile(const Problem& p, const Tile& t, int64_t u, const at::Tensor& mask, at::Tensor& out) {
  at::mul_out(out, t.cos[u], p.inv_tau + p.a_in);
  scalar_t* l = out.data_ptr<scalar_t>();
  const scalar_t* c = t.cos[u].data_ptr<scalar_t>();
  const scalar_t own = static_cast<scalar_t>(p.inv_tau + p.a_own), bias = static_cast<scalar_t>(p.bias_own);
  const scalar_t tau = static_cast<scalar_t>(p.inv_tau);
  for_each_own_negative(p, t, [&](int64_t i, int64_t j) { l[i * t.nc + j] = c[i * t.nc + j] * own + bias; });
  for_each_target(p, t, [&](int64_t i, int64_t j) { l[i * t.nc + j] = c[i * t.nc + j] * tau; });
  if (mask.defined()) out.masked_fill_(mask, -std::numeric_limits<double>::infinity());
}

// The hardest negative of each row within the tile: the largest cosine left in the softmax other than the target
// (ATen's max returns the first maximum: the lowest column on exact ties). Values -inf where none is left.
template <typename scalar_t>
void tile_hardest(const Problem& p, const Tile& t, int64_t u, const at::Tensor& mask, at::Tensor& scratch,
                  std::vector<scalar_t>& val, std::vector<int64_t>& idx) {
  scratch.copy_(t.cos[u]);
  constexpr scalar_t kNegInf = -std::numeric_limits<scalar_t>::infinity();
  if (mask.defined()) scratch.masked_fill_(mask, kNegInf);
  scalar_t* s = scratch.data_ptr<scalar_t>();
  for_each_target(p, t, [&](int64_t i, int64_t j) { s[i * t.nc + j] = kNegInf; });
  auto [v, vi] = scratch.max(1);
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const int64_t* ip = vi.data_ptr<int64_t>();
  val.assign(vp, vp + t.nr);
  idx.resize(t.nr);
  for (int64_t i = 0; i < t.nr; ++i) idx[i] = val[i] == kNegInf ? -1 : global_column(t.parts, ip[i]);
}

// Runs f(item, buffers) for item in [0, n_items) on the intra-op threads, items handed out dynamically (an atomic
// counter), so a thread that the OS preempts on a busy machine does not leave the others idle at the end.
template <typename F>
void parallel_items(const Problem& p, int64_t n_items, int64_t capacity, const F& f) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_items));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    // worker threads do not inherit the caller's thread-local state: skip autograd explicitly
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    Buffers b(p, capacity);
    for (int64_t item = next.fetch_add(1); item < n_items; item = next.fetch_add(1)) f(item, b);
  });
}

// Runs f(slot) for slot in [0, n) on the intra-op threads (independent tasks, one parallel region).
template <typename F>
void parallel_slots(int64_t n, const F& f) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t slot = begin; slot < end; ++slot) f(slot);
  });
}

struct Stats {
  at::Tensor lse, pos, hard, hidx;  // (D, n); hidx int64
  Stats(const Problem& p) {
    const auto opts = p.opts();
    // poisoned, so that a row the kernel forgets shows up as NaN, not as stale memory
    lse = at::full({p.ndims(), p.n}, NAN, opts);
    pos = at::full({p.ndims(), p.n}, NAN, opts);
    hard = at::full({p.ndims(), p.n}, NAN, opts);
    hidx = at::full({p.ndims(), p.n}, -1, opts.dtype(at::kLong));
  }
};

// Forward statistics, streaming the column tiles: online log-sum-exp per row and dimension.
template <typename scalar_t>
void stats_pass(const Problem& p, bool track_hard, Stats& out) {
  const auto tiles = column_tiles(p);
  const int64_t nblocks = (p.n + kRowBlock - 1) / kRowBlock, D = p.ndims();
  constexpr scalar_t kNegInf = -std::numeric_limits<scalar_t>::infinity();
  scalar_t* lse_p = out.lse.data_ptr<scalar_t>();
  scalar_t* pos_p = out.pos.data_ptr<scalar_t>();
  scalar_t* hs_p = out.hard.data_ptr<scalar_t>();
  int64_t* hi_p = out.hidx.data_ptr<int64_t>();
  parallel_items(p, nblocks, kRowBlock * kColTile, [&](int64_t blk, Buffers& b) {
    const int64_t r0 = blk * kRowBlock, nr = std::min(r0 + kRowBlock, p.n) - r0;
    std::vector<scalar_t> m(D * nr, kNegInf), s(D * nr, 0), best(D * nr, kNegInf), pos(D * nr, NAN), val;
    std::vector<int64_t> best_idx(D * nr, -1), idx;
    for (const auto& parts : tiles) {
      Tile t = make_tile<scalar_t>(p, r0, nr, parts, b);
      at::Tensor scratch = view2d(b.scratch, nr, t.nc);
      for (int64_t u = 0; u < D; ++u) {
        const at::Tensor mask = dim_mask<scalar_t>(p, t, u, b);
        const scalar_t* c = t.cos[u].data_ptr<scalar_t>();
        for_each_target(p, t, [&](int64_t i, int64_t j) { pos[u * nr + i] = c[i * t.nc + j]; });
        if (track_hard) {
          tile_hardest<scalar_t>(p, t, u, mask, scratch, val, idx);
          for (int64_t i = 0; i < nr; ++i) {
            if (val[i] > best[u * nr + i]) {  // strict: an equal value in a later tile keeps the lower index
              best[u * nr + i] = val[i];
              best_idx[u * nr + i] = idx[i];
            }
          }
        }
        logit_tile<scalar_t>(p, t, u, mask, scratch);
        const at::Tensor tmax = scratch.amax(1);
        const scalar_t* tm = tmax.data_ptr<scalar_t>();
        std::vector<scalar_t> shift(nr);
        for (int64_t i = 0; i < nr; ++i) {
          scalar_t& mi = m[u * nr + i];
          const scalar_t nm = std::max(mi, tm[i]);
          if (nm != mi) s[u * nr + i] *= std::exp(mi - nm);  // (mi = -inf: s is still 0)
          mi = nm;
          shift[i] = std::isinf(nm) ? scalar_t(0) : nm;  // a row with nothing finite yet adds exp(-inf) = 0
        }
        const at::Tensor sum = scratch.sub_(at::from_blob(shift.data(), {nr, 1}, p.opts())).exp_().sum(1);
        const scalar_t* sp = sum.data_ptr<scalar_t>();
        for (int64_t i = 0; i < nr; ++i) s[u * nr + i] += sp[i];
      }
    }
    for (int64_t u = 0; u < D; ++u) {
      for (int64_t i = 0; i < nr; ++i) {
        const int64_t o = u * p.n + r0 + i;
        lse_p[o] = m[u * nr + i] + std::log(s[u * nr + i]);
        pos_p[o] = pos[u * nr + i];
        if (track_hard) {
          hs_p[o] = best[u * nr + i];
          hi_p[o] = best_idx[u * nr + i];
        }
      }
    }
  });
}

// Per-row coefficients of dS at every dimension, (D, n) each: dS = cce · exp(logit - L) - cdiag · [target]
// + chg · [hardest negative hidx].
struct Coefficients {
  at::Tensor L, cce, cdiag, chg, hidx;
};

// The softmax part of dS, cce · exp(logit - L), in place of the logits in `ds`.
void softmax_part(const Tile& t, int64_t u, const Coefficients& co, at::Tensor& ds) {
  ds.sub_(co.L[u].narrow(0, t.r0, t.nr).unsqueeze(1)).exp_().mul_(co.cce[u].narrow(0, t.r0, t.nr).unsqueeze(1));
}

// dS of dimension u in `ds` from its softmax part (the one-hot terms added), then the row / column sums of
// dS ∘ cos (Q), and the coefficient tile X^u = dS ∘ r^u_i r^u_j in place of the cosines of dimension u.
template <typename scalar_t>
void grad_tile(const Problem& p, Tile& t, int64_t u, const Coefficients& co, at::Tensor& ds, scalar_t* qx,
               scalar_t* qcol) {
  const int64_t nr = t.nr, nc = t.nc;
  scalar_t* dp = ds.data_ptr<scalar_t>();
  const scalar_t* cd = co.cdiag[u].data_ptr<scalar_t>() + t.r0;
  for_each_target(p, t, [&](int64_t i, int64_t j) { dp[i * nc + j] -= cd[i]; });
  const scalar_t* ch = co.chg[u].data_ptr<scalar_t>() + t.r0;
  const int64_t* hi = co.hidx[u].data_ptr<int64_t>() + t.r0;
  for (const Part& q : t.parts) {
    const int64_t g0 = q.seg->base + q.begin;
    for (int64_t i = 0; i < nr; ++i) {
      if (ch[i] != 0 && hi[i] >= g0 && hi[i] < g0 + q.size()) dp[i * nc + q.off + hi[i] - g0] += ch[i];
    }
  }
  // one pass: the row and column sums of dS ∘ cos, and the cosine tile replaced by X^u = dS ∘ r^u_i r^u_j
  const std::vector<scalar_t> rc = column_norms<scalar_t>(p, t, u);
  const scalar_t* rx = p.rx[u].data_ptr<scalar_t>() + t.r0;
  scalar_t* c = t.cos[u].data_ptr<scalar_t>();
  for (int64_t i = 0; i < nr; ++i) {
    scalar_t* ci = c + i * nc;
    const scalar_t* di = dp + i * nc;
    const scalar_t ri = rx[i];
    scalar_t row = 0;
#pragma omp simd reduction(+ : row)
    for (int64_t j = 0; j < nc; ++j) {
      const scalar_t v = di[j] * ci[j];
      row += v;
      qcol[j] += v;
      ci[j] = di[j] * ri * rc[j];
    }
    qx[i] += row;
  }
}

// W^u = Σ_{v >= u} X^v, in place.
void suffix_sums(Tile& t) {
  for (int64_t u = static_cast<int64_t>(t.cos.size()) - 2; u >= 0; --u) t.cos[u].add_(t.cos[u + 1]);
}

// E_rows[r0:r0+nr, d_{u-1}:d_u] += W^u · z_cols[:, d_{u-1}:d_u] over the tile's columns.
void row_products(const Problem& p, const Tile& t, at::Tensor& ex) {
  at::Tensor e = ex.narrow(0, t.r0, t.nr);
  for (const Part& q : t.parts) {
    int64_t k0 = 0;
    for (size_t u = 0; u < p.dims.size(); ++u) {
      const int64_t k1 = p.dims[u];
      e.narrow(1, k0, k1 - k0).addmm_(t.cos[u].narrow(1, q.off, q.size()),
                                      q.seg->z.narrow(0, q.begin, q.size()).narrow(1, k0, k1 - k0));
      k0 = k1;
    }
  }
}

// E_cols[c, d_{u-1}:d_u] += (W^u)ᵀ · x[rows, d_{u-1}:d_u] for the tile's columns c in the global range [c0, c1).
void col_products(const Problem& p, const Tile& t, at::Tensor& ecol, int64_t c0, int64_t c1) {
  const at::Tensor xs = p.x.narrow(0, t.r0, t.nr);
  for (const Part& q : t.parts) {
    const int64_t g0 = std::max(c0, q.seg->base + q.begin), g1 = std::min(c1, q.seg->base + q.end);
    if (g0 >= g1) continue;
    const int64_t off = q.off + g0 - q.seg->base - q.begin;
    int64_t k0 = 0;
    for (size_t u = 0; u < p.dims.size(); ++u) {
      const int64_t k1 = p.dims[u];
      ecol.narrow(0, g0, g1 - g0).narrow(1, k0, k1 - k0).addmm_(t.cos[u].narrow(1, off, g1 - g0).t(),
                                                                xs.narrow(1, k0, k1 - k0));
      k0 = k1;
    }
  }
}

struct Grads {
  at::Tensor ex, qx, ecol, qcol;  // (n, d), (D, n), (m, d), (D, m)
  Grads(const Problem& p) {
    ex = at::zeros({p.n, p.d}, p.opts());
    qx = at::zeros({p.ndims(), p.n}, p.opts());
    ecol = at::zeros({p.m, p.d}, p.opts());
    qcol = at::zeros({p.ndims(), p.m}, p.opts());
  }
};

// The gradients for given coefficients, recomputing each tile once for rows and columns (Latin-square rounds).
template <typename scalar_t>
void grads_pass(const Problem& p, const Coefficients& co, Grads& g) {
  const auto tiles = column_tiles(p);
  const int64_t nblocks = (p.n + kRowBlock - 1) / kRowBlock, ntiles = static_cast<int64_t>(tiles.size());
  // more groups than threads, so that the dynamic hand-out of a round's cells can balance the load
  const int64_t groups =
      std::max<int64_t>(1, std::min<int64_t>(4 * at::get_num_threads(), std::min(nblocks, ntiles)));
  auto range = [](int64_t total, int64_t gi, int64_t groups) {
    return std::make_pair(total * gi / groups, total * (gi + 1) / groups);
  };
  scalar_t* qx = g.qx.data_ptr<scalar_t>();
  scalar_t* qc = g.qcol.data_ptr<scalar_t>();
  for (int64_t round = 0; round < groups; ++round) {
    parallel_items(p, groups, kRowBlock * kColTile, [&](int64_t gi, Buffers& b) {
      const auto rows = range(nblocks, gi, groups), cols = range(ntiles, (gi + round) % groups, groups);
      for (int64_t blk = rows.first; blk < rows.second; ++blk) {
        const int64_t r0 = blk * kRowBlock, nr = std::min(r0 + kRowBlock, p.n) - r0;
        for (int64_t ti = cols.first; ti < cols.second; ++ti) {
          Tile t = make_tile<scalar_t>(p, r0, nr, tiles[ti], b);
          const Part& q = t.parts[0];
          at::Tensor ds = view2d(b.scratch, nr, t.nc);
          for (int64_t u = 0; u < p.ndims(); ++u) {
            const at::Tensor mask = dim_mask<scalar_t>(p, t, u, b);
            logit_tile<scalar_t>(p, t, u, mask, ds);
            softmax_part(t, u, co, ds);
            grad_tile<scalar_t>(p, t, u, co, ds, qx + u * p.n + r0, qc + u * p.m + q.seg->base + q.begin);
          }
          suffix_sums(t);
          row_products(p, t, g.ex);
          col_products(p, t, g.ecol, 0, p.m);
        }
      }
    });
  }
}

// Coefficients of the fused pass and its fallback: uniform upstream gradient, cce = cw[u], chg = hw[u] where the
// hinge is active (margin + hardest - target > 0), cdiag = cce + chg; L = lse.
template <typename scalar_t>
void fused_coefficients(const scalar_t* pos, const scalar_t* hard, double cw, double hw, double margin, int64_t n,
                        scalar_t* cce, scalar_t* chg, scalar_t* cdiag) {
  for (int64_t i = 0; i < n; ++i) {
    cce[i] = static_cast<scalar_t>(cw);
    chg[i] = (hw != 0.0 && margin + hard[i] - pos[i] > 0) ? static_cast<scalar_t>(hw) : scalar_t(0);
    cdiag[i] = cce[i] + chg[i];
  }
}

Coefficients coefficients_from_stats(const Problem& p, const Stats& st, const std::vector<double>& cw,
                                     const std::vector<double>& hw, double margin) {
  Coefficients co{st.lse, at::empty({p.ndims(), p.n}, p.opts()), at::empty({p.ndims(), p.n}, p.opts()),
                  at::empty({p.ndims(), p.n}, p.opts()), st.hidx};
  AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "contrastive_coefficients", [&] {
    for (int64_t u = 0; u < p.ndims(); ++u) {
      fused_coefficients<scalar_t>(st.pos[u].data_ptr<scalar_t>(), st.hard[u].data_ptr<scalar_t>(), cw[u], hw[u],
                                   margin, p.n, co.cce[u].data_ptr<scalar_t>(), co.chg[u].data_ptr<scalar_t>(),
                                   co.cdiag[u].data_ptr<scalar_t>());
    }
  });
  return co;
}

// Forward and backward in one pass for a uniform upstream gradient. Each row block computes the stripe of every
// column (all dimensions, one sweep over d), takes the statistics from it, turns it into the coefficient tiles in
// place and uses them for E_rows (one product per chunk) and E_cols (one product per chunk). Blocks run T at a
// time (T = threads), one stripe each; their column updates go in T sub-rounds in which slot t owns column group
// (t + k) mod T (Latin square: no atomics, deterministic for a given T), and so do the column sums of Q, kept per
// slot until then.
template <typename scalar_t>
void fused_pass(const Problem& p, const std::vector<double>& cw, const std::vector<double>& hw, double margin,
                bool track_hard, int64_t block_rows, Stats& st, Grads& g) {
  const int64_t D = p.ndims(), m = p.m;
  const int64_t nblocks = (p.n + block_rows - 1) / block_rows;
  const int64_t slots = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), nblocks));
  std::vector<Buffers> bufs;
  std::vector<Tile> tiles(slots);
  std::vector<at::Tensor> qcol_part(slots);
  for (int64_t t = 0; t < slots; ++t) {
    bufs.emplace_back(p, block_rows * m);
    qcol_part[t] = at::empty({D, m}, p.opts());
  }
  const auto parts = all_columns(p);
  scalar_t* lse_p = st.lse.data_ptr<scalar_t>();
  scalar_t* pos_p = st.pos.data_ptr<scalar_t>();
  scalar_t* hs_p = st.hard.data_ptr<scalar_t>();
  int64_t* hi_p = st.hidx.data_ptr<int64_t>();
  scalar_t* qx = g.qx.data_ptr<scalar_t>();
  // the coefficients of dS, filled block by block (L: the statistics' lse)
  const Coefficients co{st.lse, at::empty({D, p.n}, p.opts()), at::empty({D, p.n}, p.opts()),
                        at::empty({D, p.n}, p.opts()), st.hidx};
  scalar_t* cce_p = co.cce.data_ptr<scalar_t>();
  scalar_t* cdiag_p = co.cdiag.data_ptr<scalar_t>();
  scalar_t* chg_p = co.chg.data_ptr<scalar_t>();
  constexpr scalar_t kNegInf = -std::numeric_limits<scalar_t>::infinity();
  for (int64_t round0 = 0; round0 < nblocks; round0 += slots) {
    const int64_t active = std::min(slots, nblocks - round0);
    // phase A: stripe -> statistics -> coefficient tiles, all in the slot's buffers
    parallel_slots(active, [&](int64_t s) {
      const int64_t r0 = (round0 + s) * block_rows, nr = std::min(r0 + block_rows, p.n) - r0;
      Buffers& b = bufs[s];
      Tile& t = tiles[s];
      t = make_tile<scalar_t>(p, r0, nr, parts, b);
      at::Tensor ds = view2d(b.scratch, nr, m);
      qcol_part[s].zero_();
      std::vector<scalar_t> val;
      std::vector<int64_t> idx;
      for (int64_t u = 0; u < D; ++u) {
        const at::Tensor mask = dim_mask<scalar_t>(p, t, u, b);
        const scalar_t* c = t.cos[u].data_ptr<scalar_t>();
        for_each_target(p, t, [&](int64_t i, int64_t j) { pos_p[u * p.n + r0 + i] = c[i * m + j]; });
        if (track_hard) {
          tile_hardest<scalar_t>(p, t, u, mask, ds, val, idx);
        } else {
          val.assign(nr, kNegInf);
          idx.assign(nr, -1);
        }
        for (int64_t i = 0; i < nr; ++i) {
          hs_p[u * p.n + r0 + i] = track_hard ? val[i] : NAN;
          hi_p[u * p.n + r0 + i] = idx[i];
        }
        logit_tile<scalar_t>(p, t, u, mask, ds);
        // the log-sum-exp from the stripe, whose exponentials are then the softmax part of dS (one exp per entry;
        // the maximum is finite: the target is never masked)
        const at::Tensor mx = ds.amax(1);
        const at::Tensor sum = ds.sub_(mx.unsqueeze(1)).exp_().sum(1);
        const scalar_t* mxp = mx.data_ptr<scalar_t>();
        const scalar_t* sump = sum.data_ptr<scalar_t>();
        const int64_t o = u * p.n + r0;
        for (int64_t i = 0; i < nr; ++i) lse_p[o + i] = mxp[i] + std::log(sump[i]);
        fused_coefficients<scalar_t>(pos_p + o, val.data(), cw[u], hw[u], margin, nr, cce_p + o, chg_p + o,
                                     cdiag_p + o);
        std::vector<scalar_t> scale(nr);
        for (int64_t i = 0; i < nr; ++i) scale[i] = cce_p[o + i] / sump[i];
        ds.mul_(at::from_blob(scale.data(), {nr, 1}, p.opts()));
        grad_tile<scalar_t>(p, t, u, co, ds, qx + o, qcol_part[s][u].data_ptr<scalar_t>());
      }
      suffix_sums(t);
    });
    // phase B: E_cols and Q_cols of column group (s + k) mod T; the last sub-round also does E_rows for the slot
    for (int64_t k = 0; k < slots; ++k) {
      parallel_slots(active, [&](int64_t s) {
        const int64_t gi = (s + k) % slots, c0 = m * gi / slots, c1 = m * (gi + 1) / slots;
        col_products(p, tiles[s], g.ecol, c0, c1);
        g.qcol.narrow(1, c0, c1 - c0).add_(qcol_part[s].narrow(1, c0, c1 - c0));
        if (k == slots - 1) row_products(p, tiles[s], g.ex);
      });
    }
  }
}

std::vector<double> to_vector(at::ArrayRef<double> v) { return std::vector<double>(v.begin(), v.end()); }

}  // namespace

#define FASTPROMPT_PROBLEM_ARGS                                                                                       \
  const at::Tensor &x, const at::Tensor &rx, at::TensorList cols, at::TensorList rcols, at::IntArrayRef dims,        \
      const c10::optional<at::Tensor> &tid, const OptTensorList &col_ids, const c10::optional<at::Tensor> &gx,      \
      const OptTensorList &gcols, const c10::optional<at::Tensor> &thr, int64_t label_offset, double inv_tau,       \
      double bias_own, double a_in, double a_own
#define FASTPROMPT_PROBLEM x, rx, cols, rcols, dims, tid, col_ids, gx, gcols, thr, label_offset, inv_tau, bias_own, a_in, a_own

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> contrastive_stats(FASTPROMPT_PROBLEM_ARGS,
                                                                             bool track_hard) {
  at::NoGradGuard no_grad;  // a kernel: autograd is handled by the Python op around it
  const Problem p = make_problem(FASTPROMPT_PROBLEM);
  Stats st(p);
  AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "contrastive_stats", [&] { stats_pass<scalar_t>(p, track_hard, st); });
  return {st.lse, st.pos, st.hard, st.hidx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> contrastive_grads(
    FASTPROMPT_PROBLEM_ARGS, const at::Tensor& L, const at::Tensor& cce, const at::Tensor& cdiag,
    const at::Tensor& chg, const at::Tensor& hidx) {
  at::NoGradGuard no_grad;
  const Problem p = make_problem(FASTPROMPT_PROBLEM);
  for (const at::Tensor* c : {&L, &cce, &cdiag, &chg}) {
    TORCH_CHECK(c->dim() == 2 && c->size(0) == p.ndims() && c->size(1) == p.n && c->scalar_type() == p.x.scalar_type(),
                "contrastive_cpu_grads: coefficients must be (len(dims), n) in the rows' dtype");
  }
  TORCH_CHECK(hidx.scalar_type() == at::kLong && hidx.sizes() == L.sizes(), "contrastive_cpu_grads: bad hidx");
  const Coefficients co{L.contiguous(), cce.contiguous(), cdiag.contiguous(), chg.contiguous(), hidx.contiguous()};
  Grads g(p);
  AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "contrastive_grads", [&] { grads_pass<scalar_t>(p, co, g); });
  return {g.ex, g.qx, g.ecol, g.qcol};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
contrastive_fused(FASTPROMPT_PROBLEM_ARGS, at::ArrayRef<double> cw_, at::ArrayRef<double> hw_, double hinge_margin,
                  bool track_hard) {
  at::NoGradGuard no_grad;
  const Problem p = make_problem(FASTPROMPT_PROBLEM);
  const std::vector<double> cw = to_vector(cw_), hw = to_vector(hw_);
  TORCH_CHECK(static_cast<int64_t>(cw.size()) == p.ndims() && static_cast<int64_t>(hw.size()) == p.ndims(),
              "contrastive_cpu_fused: one coefficient per dimension expected");
  for (double h : hw) track_hard = track_hard || h != 0.0;
  Stats st(p);
  Grads g(p);
  // buffers per row: D cosine rows and a scratch row of M
  const int64_t per_row = (p.ndims() + 1) * p.m;
  const int64_t stripe_rows = std::min<int64_t>(kMaxStripeRows, kStripeElems / std::max<int64_t>(per_row, 1));
  AT_DISPATCH_FLOATING_TYPES(p.x.scalar_type(), "contrastive_fused", [&] {
    if (stripe_rows >= std::min<int64_t>(p.n, kMinStripeRows)) {
      fused_pass<scalar_t>(p, cw, hw, hinge_margin, track_hard, std::max<int64_t>(1, stripe_rows), st, g);
    } else {  // the stripes would not fit the budget (huge M): statistics, then recompute (4 products per tile)
      stats_pass<scalar_t>(p, track_hard, st);
      grads_pass<scalar_t>(p, coefficients_from_stats(p, st, cw, hw, hinge_margin), g);
    }
  });
  return {st.lse, st.pos, st.hard, st.hidx, g.ex, g.qx, g.ecol, g.qcol};
}

#define FASTPROMPT_PROBLEM_SCHEMA                                                                                  \
  "Tensor x, Tensor rx, Tensor[] cols, Tensor[] rcols, int[] dims, Tensor? tid, Tensor?[] col_ids, Tensor? gx, " \
  "Tensor?[] gcols, Tensor? thr, int label_offset, float inv_tau, float bias_own, float a_in, float a_own"

TORCH_LIBRARY_FRAGMENT(fastprompt, m) {
  m.def("contrastive_cpu_stats(" FASTPROMPT_PROBLEM_SCHEMA
        ", bool track_hard) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("contrastive_cpu_grads(" FASTPROMPT_PROBLEM_SCHEMA
        ", Tensor L, Tensor cce, Tensor cdiag, Tensor chg, Tensor hidx) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("contrastive_cpu_fused(" FASTPROMPT_PROBLEM_SCHEMA
        ", float[] cw, float[] hw, float hinge_margin, bool track_hard) -> (Tensor, Tensor, Tensor, Tensor, Tensor, "
        "Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fastprompt, CPU, m) {
  m.impl("contrastive_cpu_stats", &contrastive_stats);
  m.impl("contrastive_cpu_grads", &contrastive_grads);
  m.impl("contrastive_cpu_fused", &contrastive_fused);
}

}  // namespace fastprompt
