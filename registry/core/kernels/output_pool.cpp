// The memory our kernels write per-sample gradients into: blocks kept mapped from one step to the next.
//
// NOTE: why a pool. A per-sample-gradient step writes B copies of each parameter's gradient (26 MB for a
// 128-256-256-10 MLP at batch 64) and frees them when the step's result goes. glibc hands that memory back to the
// kernel at the free (a block over its mmap threshold is unmapped; the top of the heap is trimmed past its trim
// threshold), so the next step writes fresh pages: every 4 KiB page faults and is zeroed by the kernel before the
// product writes it again. Measured on the MLP at batch 64, one thread: 3.1 ms a step with glibc's defaults against
// 2.6 ms with the heap kept (MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ raised), and which of the two a run
// gets moved with the heap's state (use() 0.94x to 2.0x native in reruns). Setting glibc's thresholds would change
// every allocation of the user's process; the pool keeps only the blocks our kernels made, by size, for the next
// call of the same size, which is how a training loop asks for them.
//
// NOTE: why not c10::CPUCachingAllocator. It is the same idea, built for mobile: it keeps every block it ever made
// (no bound) and frees idle ones only when it is destroyed. This pool holds at most `limit` idle bytes (a block
// freed past it goes back to the system) and can be emptied.
//
// The pool outlives every tensor (a block's deleter may run at interpreter exit): it is made once and never
// destroyed. Blocks come from c10::alloc_cpu, PyTorch's own aligned allocation, so a pooled tensor is an ordinary
// CPU tensor to every op.

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace multicomposite_pool {

namespace {

// Idle bytes held at most unless MULTICOMPOSITE_OUTPUT_POOL_MB says otherwise (0 turns the pool off).
constexpr size_t kDefaultLimitBytes = size_t{1} << 30;
constexpr const char* kLimitEnv = "MULTICOMPOSITE_OUTPUT_POOL_MB";

size_t configured_limit() {
  const char* configured = std::getenv(kLimitEnv);
  if (configured == nullptr || *configured == '\0') return kDefaultLimitBytes;
  char* end = nullptr;
  const unsigned long long megabytes = std::strtoull(configured, &end, 10);
  TORCH_CHECK(end != nullptr && *end == '\0', kLimitEnv, " must be a whole number of megabytes (got '", configured,
              "'); unset it for the default of 1024, or set 0 to turn the pool off");
  return static_cast<size_t>(megabytes) << 20;
}

class OutputPool final : public c10::Allocator {
 public:
  static OutputPool& instance() {
    static OutputPool* const pool = new OutputPool(configured_limit());  // never destroyed (above)
    return *pool;
  }

  c10::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) return {nullptr, c10::Device(c10::DeviceType::CPU)};  // nothing to keep (an empty tensor)
    void* block = take_idle(bytes);
    if (block == nullptr) {
      block = c10::alloc_cpu(bytes);
      std::lock_guard<std::mutex> lock(mutex_);
      block_bytes_[block] = bytes;
      total_bytes_ += bytes;
    }
    report(block, static_cast<int64_t>(bytes));
    return {block, block, &give_back, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &give_back; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Frees every idle block; blocks in use go back to the pool when their tensors go.
  void empty() {
    std::vector<void*> freed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [bytes, blocks] : idle_) {
        for (void* block : blocks) {
          block_bytes_.erase(block);
          freed.push_back(block);
        }
      }
      idle_.clear();
      total_bytes_ -= idle_bytes_;
      idle_bytes_ = 0;
    }
    for (void* block : freed) c10::free_cpu(block);
  }

  std::pair<size_t, size_t> held() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {idle_bytes_, total_bytes_};
  }

  bool enabled() const { return limit_ > 0; }

 private:
  explicit OutputPool(size_t limit) : limit_(limit) {}

  void* take_idle(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = idle_.find(bytes);
    if (found == idle_.end() || found->second.empty()) return nullptr;
    void* block = found->second.back();
    found->second.pop_back();
    idle_bytes_ -= bytes;
    return block;
  }

  static void give_back(void* block) { instance().keep_or_free(block); }

  void keep_or_free(void* block) {
    size_t bytes = 0;
    bool kept = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto found = block_bytes_.find(block);
      TORCH_INTERNAL_ASSERT(found != block_bytes_.end(), "multicomposite's output pool was handed a block it did "
                            "not make");
      bytes = found->second;
      kept = idle_bytes_ + bytes <= limit_;
      if (kept) {
        idle_[bytes].push_back(block);
        idle_bytes_ += bytes;
      } else {
        block_bytes_.erase(found);
        total_bytes_ -= bytes;
      }
    }
    report(block, -static_cast<int64_t>(bytes));
    if (!kept) c10::free_cpu(block);
  }

  // What PyTorch's own CPU allocator tells the profiler (torch.profiler's profile_memory): a block handed out or
  // given back, and the bytes in use and held after it.
  void report(void* block, int64_t bytes) {
    if (!c10::memoryProfilingEnabled()) return;
    const auto [idle, total] = held();
    c10::reportMemoryUsageToProfiler(block, bytes, total - idle, total, c10::Device(c10::DeviceType::CPU));
  }

  const size_t limit_;
  std::mutex mutex_;
  std::unordered_map<void*, size_t> block_bytes_;             // every block the pool made, idle or in use
  std::unordered_map<size_t, std::vector<void*>> idle_;       // idle blocks by size
  size_t idle_bytes_ = 0;
  size_t total_bytes_ = 0;  // idle and in use
};

}  // namespace

// NOTE: streaming stores. A per-sample gradient written once and not read back within the step (an embedding
// table's B copies, zeroed before a few rows are added in: 82 MB at batch 64 for a 5,000 x 64 table; linear's outer
// products) is far larger than the caches hold. Ordinary stores read each line into the cache before writing it
// (TensorIterator's fill and mul); streaming stores write the lines without reading them. Used for blocks of
// kStreamBytes and more on an AVX2 CPU (chosen at run time): `streams` decides for every kernel that writes so.
constexpr int64_t kStreamBytes = int64_t{4} << 20;

bool streams(int64_t bytes) {
#if defined(__GNUC__) && defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2 && bytes >= kStreamBytes;
#else
  return false;
#endif
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx2"))) static void stream_zero_bytes(char* begin, char* end) {
  char* aligned = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(begin) + 31) & ~uintptr_t{31});
  if (aligned > end) aligned = end;
  std::memset(begin, 0, static_cast<size_t>(aligned - begin));
  const __m256i zeros = _mm256_setzero_si256();
  char* at = aligned;
  for (; at + 32 <= end; at += 32) _mm256_stream_si256(reinterpret_cast<__m256i*>(at), zeros);
  std::memset(at, 0, static_cast<size_t>(end - at));
  _mm_sfence();  // the streamed lines are visible to every core before the block is used
}
#endif

// `t` zeroed; streamed where `streams` says so. Quantized tensors (whose zero is not all-zero bits) take zero_().
void zero(at::Tensor& t) {
#if defined(__GNUC__) && defined(__x86_64__)
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  if (t.device().is_cpu() && t.is_contiguous() && !t.is_quantized() && streams(bytes)) {
    char* data = static_cast<char*>(t.mutable_data_ptr());
    at::parallel_for(0, bytes, at::internal::GRAIN_SIZE * 64, [&](int64_t begin, int64_t end) {
      stream_zero_bytes(data + begin, data + end);
    });
    return;
  }
#endif
  t.zero_();
}

at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  OutputPool& pool = OutputPool::instance();
  if (!pool.enabled() || options.device().type() != c10::DeviceType::CPU) return at::empty(sizes, options);
  return at::detail::empty_generic(sizes, &pool, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), std::nullopt);
}

}  // namespace multicomposite_pool

namespace {

// (idle bytes, all bytes the pool holds), for tests and the docs' measurements.
std::vector<int64_t> output_pool_bytes() {
  const auto [idle, total] = multicomposite_pool::OutputPool::instance().held();
  return {static_cast<int64_t>(idle), static_cast<int64_t>(total)};
}

void empty_output_pool() { multicomposite_pool::OutputPool::instance().empty(); }

// `self` zeroed as the pool zeroes per-sample gradients (streaming stores for large contiguous blocks): the bench's
// floor writes its per-sample gradients this way, the fastest write of this machine that our kernels use.
at::Tensor& zero_streaming_(at::Tensor& self) {
  multicomposite_pool::zero(self);
  return self;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(multicomposite, m) {
  m.def("output_pool_bytes() -> int[]", output_pool_bytes);
  m.def("empty_output_pool() -> ()", empty_output_pool);
  m.def("zero_streaming_(Tensor(a!) self) -> Tensor(a!)", zero_streaming_);
}
