// The device paged cache and device LoSA (sparsa/device_losa.h): validation and the host's
// bookkeeping (sequence runs, lengths, steps in the block); every kernel is in src/cuda/losa/.
#include "sparsa/device_losa.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/backends.h"
#include "core/validate.h"
#include "methods/losa/device_impl.h"

namespace sparsa {

static_assert(kDeviceLosaMaxBatch == losa_cuda::kMaxBatch, "one batch limit");

namespace {

std::string str(int64_t x) { return std::to_string(x); }

Status check_device(const char* name, int device) {
  // Not compiled in, or compiled in with no device visible: backend_status says which.
  if (const Status why = backend_status(Backend::cuda); !why.ok()) {
    return Status(why.code(), std::string(name) + ": " + why.message());
  }
  if (device < 0 || device >= cuda::device_count()) {
    return invalid_argument(std::string(name) + ": expected a cuda device id in [0, " + str(cuda::device_count()) +
                            "), got " + str(device));
  }
  return {};
}

// name: [batch, heads, rows, dim] in `dtype` on cuda:device.
Status check_device_tensor(const char* name, const Tensor& t, int device, DType dtype,
                           std::initializer_list<int64_t> shape) {
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor(name, t, Device{DeviceType::cuda, device}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype(name, t, dtype));
  return detail::check_shape(name, t, shape);
}

// Batch entries [b, b + count) of t (a view).
Tensor entries(const Tensor& t, int64_t b, int64_t count) {
  Tensor e = t;
  e.data = static_cast<std::byte*>(t.data) + b * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  e.shape[0] = count;
  return e;
}
// Batch entry b of t, as a batch of one.
Tensor entry(const Tensor& t, int64_t b) { return entries(t, b, 1); }

}  // namespace

// ---- DevicePagedKVCache ------------------------------------------------------------------------

Result<DevicePagedKVCache> DevicePagedKVCache::create(const DeviceKVCacheConfig& c) {
  if (c.heads_kv < 1 || c.heads_kv > 1024) return invalid_argument("heads_kv: expected 1 to 1024, got " + str(c.heads_kv));
  if (c.head_dim != 64 && c.head_dim != 128) {
    return Status(StatusCode::unsupported, "head_dim: the device cache takes 64 or 128, got " + str(c.head_dim));
  }
  if (c.page_size < 1 || c.page_size > losa_cuda::kMaxPageSize) {
    return invalid_argument("page_size: expected 1 to " + str(losa_cuda::kMaxPageSize) + ", got " + str(c.page_size));
  }
  if (c.dtype != DType::bf16 && c.dtype != DType::f16) {
    return unsupported_dtype(std::string("dtype: the device cache holds bf16 or f16, got ") + dtype_name(c.dtype));
  }
  if (c.pool_pages < 1) return invalid_argument("pool_pages: expected >= 1, got " + str(c.pool_pages));
  if (c.pool_pages > ((int64_t{1} << 31) - 1) / c.page_size) {  // pool_pages * page_size would overflow first
    return invalid_argument("pool_pages: at most 2^31 - 1 tokens per kv head, got " + str(c.pool_pages) + " pages of " +
                            str(c.page_size));
  }
  SPARSA_RETURN_IF_ERROR(check_device("device", c.device));
  DevicePagedKVCache cache;
  cache.config_ = c;
  const Device dev{DeviceType::cuda, c.device};
  const int64_t tokens = c.pool_pages * c.page_size;
  for (auto [array, rows] : {std::pair{&cache.k_, tokens}, std::pair{&cache.v_, tokens},
                             std::pair{&cache.min_, c.pool_pages}, std::pair{&cache.max_, c.pool_pages}}) {
    auto a = DeviceArray::allocate(c.dtype, {c.heads_kv, rows, c.head_dim}, dev, /*zero_fill=*/true, c.stream);
    if (!a.ok()) return a.status();
    *array = std::move(a).value();
  }
  return cache;
}

int64_t DevicePagedKVCache::free_pages() const {
  int64_t used = 0;
  for (const Sequence& s : sequences_) used += s.live ? s.pages : 0;
  return config_.pool_pages - used;
}

Result<int> DevicePagedKVCache::add_sequence(int64_t max_tokens) {
  if (k_.empty()) return invalid_argument("cache: not created (use DevicePagedKVCache::create)");
  if (max_tokens < 1) return invalid_argument("max_tokens: expected >= 1, got " + str(max_tokens));
  if (max_tokens > config_.pool_pages * config_.page_size) {  // (at most 2^31 - 1: create checks)
    return Status(StatusCode::out_of_memory, "max_tokens: " + str(max_tokens) + " tokens exceed the pool of " +
                                                 str(config_.pool_pages) + " pages of " + str(config_.page_size));
  }
  const int64_t pages = (max_tokens + config_.page_size - 1) / config_.page_size;
  // First fit over the gaps between the live runs, in pool order.
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const Sequence& s : sequences_)
    if (s.live) runs.emplace_back(s.first_page, s.first_page + s.pages);
  std::sort(runs.begin(), runs.end());
  int64_t start = 0;
  for (auto [begin, end] : runs) {
    if (begin - start >= pages) break;
    start = std::max(start, end);
  }
  if (config_.pool_pages - start < pages) {
    return Status(StatusCode::out_of_memory, "max_tokens: " + str(max_tokens) + " tokens need " + str(pages) +
                                           " consecutive pages; the pool of " + str(config_.pool_pages) +
                                           " pages has no free run that long (" + str(free_pages()) + " pages free)");
  }
  sequences_.push_back({start, pages, 0, true});
  return static_cast<int>(sequences_.size() - 1);
}

Result<DevicePagedKVCache::Sequence*> DevicePagedKVCache::find(int seq) {
  if (seq < 0 || seq >= static_cast<int>(sequences_.size()) || !sequences_[seq].live) {
    return invalid_argument("seq: no sequence " + str(seq) + " in the cache (" + str(sequences_.size()) +
                            " added, removed ones are gone)");
  }
  return &sequences_[seq];
}
Result<const DevicePagedKVCache::Sequence*> DevicePagedKVCache::find(int seq) const {
  auto s = const_cast<DevicePagedKVCache*>(this)->find(seq);
  if (!s.ok()) return s.status();
  return static_cast<const Sequence*>(s.value());
}

Status DevicePagedKVCache::remove_sequence(int seq) {
  auto s = find(seq);
  if (!s.ok()) return s.status();
  (*s)->live = false;
  return {};
}

Status DevicePagedKVCache::reset(int seq) {
  auto s = find(seq);
  if (!s.ok()) return s.status();
  (*s)->length = 0;
  return {};
}

Status DevicePagedKVCache::append(int seq, const Tensor& k, const Tensor& v, void* stream) {
  auto s = find(seq);
  if (!s.ok()) return s.status();
  Sequence& sq = **s;
  SPARSA_RETURN_IF_ERROR(detail::check_attention_tensor("k", k, Device{DeviceType::cuda, config_.device}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("k", k, config_.dtype));
  const int64_t n = k.shape[2];
  SPARSA_RETURN_IF_ERROR(detail::check_shape("k", k, {1, config_.heads_kv, n, config_.head_dim}));
  SPARSA_RETURN_IF_ERROR(check_device_tensor("v", v, config_.device, config_.dtype, {1, config_.heads_kv, n, config_.head_dim}));
  if (sq.length + n > sq.pages * config_.page_size) {
    return Status(StatusCode::out_of_memory, "k: appending " + str(n) + " tokens to sequence " + str(seq) + " of length " +
                                           str(sq.length) + " exceeds its " + str(sq.pages * config_.page_size) +
                                           " tokens (" + str(sq.pages) + " pages)");
  }
  losa_cuda::Pool pool{config_.dtype, config_.device, config_.heads_kv, config_.head_dim, config_.pool_pages,
                       config_.page_size, k_.data(), v_.data(), min_.data(), max_.data()};
  SPARSA_RETURN_IF_ERROR(losa_cuda::append(pool, sq.first_page, sq.length, k, v, stream));
  sq.length += n;
  return {};
}

Result<int64_t> DevicePagedKVCache::length(int seq) const {
  auto s = find(seq);
  if (!s.ok()) return s.status();
  return (*s)->length;
}
Result<int64_t> DevicePagedKVCache::capacity(int seq) const {
  auto s = find(seq);
  if (!s.ok()) return s.status();
  return (*s)->pages * config_.page_size;
}
Result<DevicePagedKVCache::SequenceView> DevicePagedKVCache::sequence(int seq) const {
  auto s = find(seq);
  if (!s.ok()) return s.status();
  return SequenceView{(*s)->first_page, (*s)->pages, (*s)->length};
}

Result<Tensor> DevicePagedKVCache::view(int seq, const DeviceArray& pool, int64_t rows_per_head, bool per_page) const {
  auto s = find(seq);
  if (!s.ok()) return s.status();
  const Sequence& sq = **s;
  const int64_t rows = per_page ? (sq.length + config_.page_size - 1) / config_.page_size : sq.length;
  if (rows == 0) return Tensor{};
  const int64_t first = per_page ? sq.first_page : sq.first_page * config_.page_size;
  const int64_t d = config_.head_dim;
  Tensor t = Tensor::contiguous(static_cast<std::byte*>(pool.data()) + first * d * dtype_size(config_.dtype),
                                config_.dtype, {1, config_.heads_kv, rows, d}, pool.device());
  t.strides[0] = config_.heads_kv * rows_per_head * d;
  t.strides[1] = rows_per_head * d;
  return t;
}
Result<Tensor> DevicePagedKVCache::keys(int seq) const { return view(seq, k_, config_.pool_pages * config_.page_size, false); }
Result<Tensor> DevicePagedKVCache::values(int seq) const { return view(seq, v_, config_.pool_pages * config_.page_size, false); }
Result<Tensor> DevicePagedKVCache::page_min(int seq) const { return view(seq, min_, config_.pool_pages, true); }
Result<Tensor> DevicePagedKVCache::page_max(int seq) const { return view(seq, max_, config_.pool_pages, true); }

// ---- DevicePrefixAttention ---------------------------------------------------------------------

Result<DevicePrefixAttention> DevicePrefixAttention::create(const DeviceLosaConfig& c, const LosaOptions& o,
                                                            int device, DType dtype, void* stream) {
  if (c.batch < 1 || c.batch > losa_cuda::kMaxBatch) {
    return invalid_argument("batch: expected 1 to " + str(losa_cuda::kMaxBatch) + " sequences, got " + str(c.batch));
  }
  if (c.heads_kv < 1 || c.heads_kv > 1024) return invalid_argument("heads_kv: expected 1 to 1024, got " + str(c.heads_kv));
  // At most 4096 query heads: the candidates kernel's grid holds heads_kv x (up to 4 x group)
  // chunks in its y dimension (at most 65535).
  if (c.heads_q < 1 || c.heads_q > 4096 || c.heads_q % c.heads_kv != 0) {
    return invalid_argument("heads_q: expected a multiple of heads_kv (" + str(c.heads_kv) + ") from 1 to 4096, got " +
                            str(c.heads_q));
  }
  if (c.head_dim != 64 && c.head_dim != 128) {
    return Status(StatusCode::unsupported, "head_dim: the device path takes 64 or 128, got " + str(c.head_dim));
  }
  if (c.block_size < 1 || c.block_size > losa_cuda::kMaxBlock) {
    return invalid_argument("block_size: the device path takes 1 to " + str(losa_cuda::kMaxBlock) + " tokens, got " +
                            str(c.block_size));
  }
  if (dtype != DType::bf16 && dtype != DType::f16) {
    return unsupported_dtype(std::string("dtype: the device path takes bf16 or f16, got ") + dtype_name(dtype));
  }
  if (o.method != PrefixMethod::dense && o.method != PrefixMethod::quest && o.method != PrefixMethod::losa &&
      o.method != PrefixMethod::reuse) {
    return invalid_argument("method: expected dense, quest, losa or reuse, got " + str(static_cast<int>(o.method)));
  }
  if (o.select.selector != PageSelector::quest) {
    return Status(StatusCode::unsupported, "selector: the device path selects with quest only");
  }
  if (o.select.group != GroupPolicy::per_head) {
    return Status(StatusCode::unsupported, "group: the device path selects per_head only");
  }
  if (o.attention.backend != Backend::cuda) {
    return invalid_argument(std::string("backend: the device path runs on cuda, got ") + backend_name(o.attention.backend));
  }
  if (o.method == PrefixMethod::losa || o.method == PrefixMethod::reuse) {
    if (o.mse_threshold) {
      if (!std::isfinite(*o.mse_threshold) || *o.mse_threshold < 0) {
        return invalid_argument("mse_threshold: expected a finite number >= 0, got " + std::to_string(*o.mse_threshold));
      }
    } else if (o.active_k < 0 || o.active_k > c.block_size) {
      return invalid_argument("active_k: expected 0 to block_size (" + str(c.block_size) + "), got " + str(o.active_k));
    }
  }
  if (o.select.budget <= 0) return invalid_argument("budget: expected > 0 tokens per query, got " + str(o.select.budget));
  SPARSA_RETURN_IF_ERROR(check_device("device", device));
  DevicePrefixAttention pa;
  pa.config_ = c;
  pa.steps_in_block_.assign(static_cast<size_t>(c.batch), 0);
  pa.options_ = o;
  pa.device_ = device;
  pa.dtype_ = dtype;
  const Device dev{DeviceType::cuda, device};
  const int64_t B = c.batch, H = c.heads_q, Bb = c.block_size, D = c.head_dim;
  struct Want {
    DeviceArray* array;
    DType dtype;
    std::vector<int64_t> shape;
  };
  // capacity is set per cache page size at the first step (budget / page_size).
  for (Want w : {Want{&pa.o_p_, dtype, {B, H, Bb, D}}, Want{&pa.l_p_, DType::f32, {B, H, Bb}},
                 Want{&pa.q_ref_, dtype, {B, H, Bb, D}}, Want{&pa.active_, DType::i32, {B, Bb}},
                 Want{&pa.active_counts_, DType::i32, {B}}, Want{&pa.plan_counts_, DType::i32, {B, H, Bb}},
                 Want{&pa.mse_, DType::i32, {B, Bb, 2}}}) {
    auto a = DeviceArray::allocate(w.dtype, w.shape, dev, /*zero_fill=*/true, stream);
    if (!a.ok()) return a.status();
    *w.array = std::move(a).value();
  }
  if (o.method == PrefixMethod::reuse) {  // every row's dense prefix, before the active rows adopt theirs
    for (Want w : {Want{&pa.o_new_, dtype, {B, H, Bb, D}}, Want{&pa.l_new_, DType::f32, {B, H, Bb}}}) {
      auto a = DeviceArray::allocate(w.dtype, w.shape, dev, /*zero_fill=*/true, stream);
      if (!a.ok()) return a.status();
      *w.array = std::move(a).value();
    }
  }
  return pa;
}

Status DevicePrefixAttention::step(const DevicePagedKVCache& cache, const std::vector<int>& seqs, const Tensor& q,
                                   const Tensor& k_block, const Tensor& v_block, const Tensor& out, const Tensor& lse,
                                   void* stream) {
  if (o_p_.empty()) return invalid_argument("DevicePrefixAttention: not created (use DevicePrefixAttention::create)");
  if (static_cast<int64_t>(seqs.size()) != config_.batch) {
    return invalid_argument("seqs: expected " + str(config_.batch) + " sequence ids (the batch), got " +
                            str(seqs.size()));
  }
  return step_entries(0, cache, seqs, q, k_block, v_block, out, lse, stream);
}

Status DevicePrefixAttention::step_entries(int64_t first, const DevicePagedKVCache& cache,
                                           const std::vector<int>& seqs, const Tensor& q, const Tensor& k_block,
                                           const Tensor& v_block, const Tensor& out, const Tensor& lse, void* stream) {
  if (o_p_.empty()) return invalid_argument("DevicePrefixAttention: not created (use DevicePrefixAttention::create)");
  const DeviceKVCacheConfig& cc = cache.config();
  const int64_t B = config_.batch, H = config_.heads_q, Hkv = config_.heads_kv, Bb = config_.block_size,
                D = config_.head_dim;
  if (cc.heads_kv != Hkv || cc.head_dim != D || cc.dtype != dtype_ || cc.device != device_) {
    return invalid_argument("cache: expected heads_kv " + str(Hkv) + ", head_dim " + str(D) + ", " + dtype_name(dtype_) +
                            " on cuda:" + str(device_) + ", got " + str(cc.heads_kv) + ", " + str(cc.head_dim) + ", " +
                            dtype_name(cc.dtype) + " on cuda:" + str(cc.device));
  }
  if (first < 0 || first >= B) {
    return invalid_argument("first: expected an entry of the batch in [0, " + str(B) + "), got " + str(first));
  }
  const int64_t n = static_cast<int64_t>(seqs.size());
  if (n < 1 || first + n > B) {
    return invalid_argument("seqs: expected 1 to " + str(B - first) + " sequence ids (entries " + str(first) +
                            " onward of a batch of " + str(B) + "), got " + str(n));
  }
  SPARSA_RETURN_IF_ERROR(check_device_tensor("q", q, device_, dtype_, {n, H, Bb, D}));
  SPARSA_RETURN_IF_ERROR(check_device_tensor("k_block", k_block, device_, dtype_, {n, Hkv, Bb, D}));
  SPARSA_RETURN_IF_ERROR(check_device_tensor("v_block", v_block, device_, dtype_, {n, Hkv, Bb, D}));
  SPARSA_RETURN_IF_ERROR(check_device_tensor("out", out, device_, dtype_, {n, H, Bb, D}));
  SPARSA_RETURN_IF_ERROR(detail::check_shape("lse", lse, {n, H, Bb}));
  SPARSA_RETURN_IF_ERROR(detail::check_dtype("lse", lse, DType::f32));
  if (!(lse.device == Device{DeviceType::cuda, device_})) {
    return invalid_argument("lse: expected a tensor on cuda:" + str(device_) + ", got " + device_name(lse.device));
  }
  const int64_t keep = options_.select.budget / cc.page_size;
  // The page budget matters where pages are selected (as the CPU's validate: losa and quest).
  if ((options_.method == PrefixMethod::losa || options_.method == PrefixMethod::quest) &&
      (options_.select.budget % cc.page_size != 0 ||
       keep < int64_t{options_.select.force_first} + int64_t{options_.select.force_last})) {
    SPARSA_RETURN_IF_ERROR(validate(options_.select, cc.page_size));
  }
  int64_t max_pages = 0;
  for (int64_t b = 0; b < n; ++b) {
    auto s = cache.sequence(seqs[b]);
    if (!s.ok()) return Status(s.status().code(), "seqs[" + str(b) + "]: " + s.status().message());
    for (int64_t c = 0; c < b; ++c) {
      if (seqs[c] == seqs[b]) return invalid_argument("seqs: sequence " + str(seqs[b]) + " appears twice in the batch");
    }
    max_pages = std::max(max_pages, (s->length + cc.page_size - 1) / cc.page_size);
  }
  const PrefixMethod m = options_.method;
  // An entry's first step of a block is dense for losa and reuse; the later steps of reuse are
  // dense for the active rows (no pages are selected).
  auto dense_prefix = [&](int64_t e) {
    return m == PrefixMethod::dense || ((m == PrefixMethod::losa || m == PrefixMethod::reuse) && steps_in_block_[e] == 0);
  };

  // The page plan and the candidates' scratch (for the whole batch), sized before any launch
  // (grown only when a longer prefix or another page size comes: a step captured in a graph then
  // allocates nothing).
  bool any_sparse = false;
  for (int64_t b = 0; b < n; ++b) any_sparse = any_sparse || (!dense_prefix(first + b) && m != PrefixMethod::reuse);
  if (any_sparse) {
    // The selection's shared memory grows with the prefix: a prefix too long for it is refused
    // here, before any entry's launches.
    if (Status fits = losa_cuda::sparse_step_fits(dtype_, D, max_pages, keep, options_.attend_union, device_);
        !fits.ok()) {
      return Status(fits.code(), "seqs: the longest prefix, " + str(max_pages) + " pages of " + str(cc.page_size) +
                                     " tokens, keeping " + str(keep) + " pages a row, needs more shared memory than " +
                                     "cuda:" + str(device_) + " gives a block (" + fits.message() +
                                     "); a larger page_size or a smaller budget fits");
    }
    if (capacity_ != keep || plan_pages_.empty()) {
      auto pages = DeviceArray::allocate(DType::i32, {B, H, Bb, std::max<int64_t>(keep, 1)},
                                         Device{DeviceType::cuda, device_}, true, stream);
      if (!pages.ok()) return pages.status();
      plan_pages_ = std::move(pages).value();
      capacity_ = keep;
      candidate_tiles_ = 0;  // the candidates' rows depend on the capacity too
    }
    const int64_t tiles = losa_cuda::candidate_tiles(max_pages);
    if (tiles > candidate_tiles_) {
      // 64-bit keys, as pairs of i32 words.
      auto cand = DeviceArray::allocate(DType::i32, {B, H, Bb, tiles, losa_cuda::tile_keep(keep), 2},
                                        Device{DeviceType::cuda, device_}, false, stream);
      if (!cand.ok()) return cand.status();
      candidates_ = std::move(cand).value();
      candidate_tiles_ = tiles;
    }
  }
  // Runs of consecutive entries in one phase (their block's first step or not): one launch
  // sequence each.
  for (int64_t r0 = 0; r0 < n;) {
    const bool phase = dense_prefix(first + r0);
    int64_t r1 = r0 + 1;
    while (r1 < n && dense_prefix(first + r1) == phase) ++r1;
    const std::vector<int> run_seqs(seqs.begin() + r0, seqs.begin() + r1);
    SPARSA_RETURN_IF_ERROR(run_entries(first + r0, r1 - r0, steps_in_block_[first + r0] == 0, cache, run_seqs,
                                       entries(q, r0, r1 - r0), entries(k_block, r0, r1 - r0),
                                       entries(v_block, r0, r1 - r0), entries(out, r0, r1 - r0),
                                       entries(lse, r0, r1 - r0), stream));
    r0 = r1;
  }
  for (int64_t b = 0; b < n; ++b) ++steps_in_block_[first + b];
  return {};
}

Status DevicePrefixAttention::run_entries(int64_t first, int64_t count, bool first_step,
                                          const DevicePagedKVCache& cache, const std::vector<int>& seqs,
                                          const Tensor& q, const Tensor& k_block, const Tensor& v_block,
                                          const Tensor& out, const Tensor& lse, void* stream) {
  const DeviceKVCacheConfig& cc = cache.config();
  const int64_t B = config_.batch, D = config_.head_dim;
  // Entry `first` of a state array laid out [batch, ...]: the runs' arrays start there.
  auto at = [&](const DeviceArray& a) -> void* {
    return a.empty() ? nullptr : static_cast<std::byte*>(a.data()) + a.nbytes() / static_cast<size_t>(B) * first;
  };
  losa_cuda::StepArgs a;
  a.pool = {cc.dtype,          cc.device,         cc.heads_kv,        cc.head_dim,       cc.pool_pages,
            cc.page_size,      cache.pool_keys().data(), cache.pool_values().data(), cache.pool_min().data(),
            cache.pool_max().data()};
  a.stream = stream;
  a.batch = count;
  a.heads_q = config_.heads_q;
  a.block = config_.block_size;
  for (int64_t b = 0; b < count; ++b) {
    auto s = cache.sequence(seqs[b]);
    if (!s.ok()) return s.status();
    a.seqs[b] = {s->first_page, s->length};
  }
  a.q = q;
  a.k_block = k_block;
  a.v_block = v_block;
  a.out = out;
  a.lse = lse;
  a.scale = options_.attention.scale.value_or(1.0f / std::sqrt(static_cast<float>(D)));
  const PrefixMethod m = options_.method;
  const bool dense_prefix =
      m == PrefixMethod::dense || ((m == PrefixMethod::losa || m == PrefixMethod::reuse) && first_step);
  a.o_p = at(o_p_);
  a.l_p = static_cast<float*>(at(l_p_));
  a.q_ref = at(q_ref_);
  a.active = static_cast<int32_t*>(at(active_));
  a.active_counts = static_cast<int32_t*>(at(active_counts_));
  a.plan_pages = static_cast<int32_t*>(at(plan_pages_));
  a.plan_counts = static_cast<int32_t*>(at(plan_counts_));
  a.capacity = capacity_;
  a.candidates = static_cast<uint64_t*>(at(candidates_));
  a.candidate_tiles = candidate_tiles_;
  a.mse = static_cast<double*>(at(mse_));
  a.all_rows = first_step || (m != PrefixMethod::losa && m != PrefixMethod::reuse);
  a.active_k = options_.active_k;
  a.use_threshold = options_.mse_threshold.has_value();
  a.threshold = options_.mse_threshold.value_or(0.0);
  a.force_first = options_.select.force_first;
  a.force_last = options_.select.force_last;
  a.attend_union = options_.attend_union;

  const bool reuse = !dense_prefix && m == PrefixMethod::reuse;
  if (!dense_prefix && !reuse) return losa_cuda::sparse_step(a);
  // Every row, through the dense executor (split-KV for a long prefix), into O_p and L_p; for
  // reuse into scratch, from which the active rows (chosen first, from Q_ref as it was) adopt theirs.
  SPARSA_RETURN_IF_ERROR(reuse ? losa_cuda::reuse_rows(a) : losa_cuda::dense_rows(a));
  const DeviceArray& o_dst = reuse ? o_new_ : o_p_;
  const DeviceArray& l_dst = reuse ? l_new_ : l_p_;
  AttentionOptions ao;
  ao.backend = Backend::cuda;
  ao.scale = a.scale;
  ao.stream = stream;
  for (int64_t b = 0; b < count; ++b) {
    if (a.seqs[b].length == 0) continue;  // no prefix: block_merge takes the block alone
    const Tensor qb = entry(q, b);
    const Tensor ob = entry(o_dst.view(), first + b), lb = entry(l_dst.view(), first + b);
    // The prefix read in place: the sequence's run of pages as one strided view.
    auto kb = cache.keys(seqs[b]), vb = cache.values(seqs[b]);
    if (!kb.ok()) return kb.status();
    if (!vb.ok()) return vb.status();
    SPARSA_RETURN_IF_ERROR(dense(qb, kb.value(), vb.value(), ob, lb, ao));
  }
  if (reuse) SPARSA_RETURN_IF_ERROR(losa_cuda::adopt_rows(a, at(o_new_), static_cast<const float*>(at(l_new_))));
  return losa_cuda::block_merge(a, /*qref_all=*/!reuse);
}

void DevicePrefixAttention::begin_block() { std::fill(steps_in_block_.begin(), steps_in_block_.end(), 0); }

void DevicePrefixAttention::begin_block(int64_t entry) {
  if (entry >= 0 && entry < static_cast<int64_t>(steps_in_block_.size())) steps_in_block_[entry] = 0;
}

int64_t DevicePrefixAttention::steps_in_block(int64_t entry) const {
  return entry >= 0 && entry < static_cast<int64_t>(steps_in_block_.size()) ? steps_in_block_[entry] : 0;
}

Status DevicePrefixAttention::commit(DevicePagedKVCache& cache, const std::vector<int>& seqs, const Tensor& k_block,
                                     const Tensor& v_block, void* stream) {
  if (o_p_.empty()) return invalid_argument("DevicePrefixAttention: not created (use DevicePrefixAttention::create)");
  const int64_t B = config_.batch;
  if (static_cast<int64_t>(seqs.size()) != B) {
    return invalid_argument("seqs: expected " + str(B) + " sequence ids (the batch), got " + str(seqs.size()));
  }
  const std::initializer_list<int64_t> shape = {B, config_.heads_kv, config_.block_size, config_.head_dim};
  SPARSA_RETURN_IF_ERROR(check_device_tensor("k_block", k_block, device_, dtype_, shape));
  SPARSA_RETURN_IF_ERROR(check_device_tensor("v_block", v_block, device_, dtype_, shape));
  // Every sequence named once and with room before anything is written.
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t a = 0; a < b; ++a)
      if (seqs[a] == seqs[b]) {
        return invalid_argument("seqs[" + str(b) + "]: sequence " + str(seqs[b]) + " is also seqs[" + str(a) +
                                "]; a commit appends one block to each sequence once");
      }
    auto len = cache.length(seqs[b]);
    if (!len.ok()) return Status(len.status().code(), "seqs[" + str(b) + "]: " + len.status().message());
    if (*len + config_.block_size > cache.capacity(seqs[b]).value()) {
      return Status(StatusCode::out_of_memory, "seqs[" + str(b) + "]: committing " + str(config_.block_size) +
                                             " tokens to sequence " + str(seqs[b]) + " of length " + str(*len) +
                                             " exceeds its " + str(cache.capacity(seqs[b]).value()) + " tokens");
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    SPARSA_RETURN_IF_ERROR(cache.append(seqs[b], entry(k_block, b), entry(v_block, b), stream));
  }
  begin_block();
  return {};
}

}  // namespace sparsa
