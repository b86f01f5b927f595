// A bounded cache of freed output buffers for the CPU kernels.
//
// Why: glibc hands a freed block larger than its mmap threshold (128 KiB, adapting up to 32 MiB)
// back to the kernel, and trims the top of its heap the same way; the next allocation of that
// size then faults in fresh zeroed pages, ~0.1-0.3 µs per 4 KiB page. Inside a model a norm's
// output is a few MiB, freed a layer later and asked for again at the same size by the next norm,
// so the faults cost as much as the norm itself (measured in a GPT-2 forward at (1024, 768): 390 µs
// for aten::layer_norm against 230 µs for the same call alone). Recycling those blocks, as the
// CUDA caching allocator does on GPUs, removes that cost.
//
// What: blocks of at least kMinBytes (smaller ones come from glibc's heap without faults) are
// rounded up to kGranule and, when the last tensor using one dies, kept on a free list instead of
// being freed, up to a byte limit (NORMFOLD_CPU_CACHE_MB, default 256; 0 turns the cache off).
// Past the limit the oldest kept blocks are freed. empty() frees them all (normfold.ops.empty_cpu_cache).
// The singleton is never destroyed, so tensors that die during interpreter shutdown still find it.
// A forked child starts with an empty cache and a fresh lock (another thread may have held the
// parent's at the fork); the blocks the parent kept stay the parent's.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <pthread.h>

#include <cstdlib>
#include <deque>
#include <new>
#include <iterator>
#include <mutex>
#include <string>
#include <tuple>

namespace normfold {

class OutputCache final : public c10::Allocator {
 public:
  static constexpr size_t kMinBytes = size_t(256) << 10;
  static constexpr size_t kGranule = size_t(64) << 10;
  static constexpr size_t kAlignment = 64;  // as c10's CPU allocator

  static OutputCache& instance() {
    static OutputCache* cache = [] {
      auto* c = new OutputCache();  // leaked on purpose: see the header comment
      pthread_atfork(nullptr, nullptr, &after_fork_in_child);
      return c;
    }();
    return *cache;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinBytes || limit_ == 0) return c10::GetCPUAllocator()->allocate(n);
    const size_t bytes = (n + kGranule - 1) / kGranule * kGranule;
    {
      std::lock_guard<std::mutex> guard(mu_);
      for (auto it = free_.rbegin(); it != free_.rend(); ++it) {  // newest first: warmest in cache
        if (it->bytes == bytes) {
          Block* block = new Block(*it);
          free_.erase(std::next(it).base());
          cached_ -= bytes;
          ++hits_;
          return {block->ptr, block, &release, c10::Device(c10::DeviceType::CPU)};
        }
      }
      ++misses_;
    }
    void* ptr = nullptr;
    if (posix_memalign(&ptr, kAlignment, bytes) != 0 || ptr == nullptr) {
      empty();  // what we keep may be what is missing
      TORCH_CHECK(posix_memalign(&ptr, kAlignment, bytes) == 0 && ptr != nullptr,
                  "normfold: out of memory allocating ", bytes, " bytes");
    }
    return {ptr, new Block{ptr, bytes}, &release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // (cached bytes, blocks, hits, misses, limit bytes)
  std::tuple<size_t, size_t, size_t, size_t, size_t> info() {
    std::lock_guard<std::mutex> guard(mu_);
    return {cached_, free_.size(), hits_, misses_, limit_};
  }

  void empty() {
    std::deque<Block> dropped;
    {
      std::lock_guard<std::mutex> guard(mu_);
      dropped.swap(free_);
      cached_ = 0;
    }
    for (const Block& b : dropped) std::free(b.ptr);
  }

 private:
  struct Block {
    void* ptr;
    size_t bytes;
  };

  OutputCache() {
    const char* env = std::getenv("NORMFOLD_CPU_CACHE_MB");
    size_t mb = 256;
    if (env != nullptr && *env != '\0') {
      char* end = nullptr;
      const long long parsed = std::strtoll(env, &end, 10);
      if (end != env && *end == '\0' && parsed >= 0) mb = size_t(parsed);
    }
    limit_ = mb << 20;
  }

  static void release(void* ctx) { instance().put(static_cast<Block*>(ctx)); }

  static void after_fork_in_child() {
    OutputCache& c = instance();
    new (&c.mu_) std::mutex();            // the old one may be locked by a thread that no longer exists
    new (&c.free_) std::deque<Block>();   // and the list mid-update: forget it (its memory is a copy)
    c.cached_ = 0;
  }

  void put(Block* block) {
    const Block b = *block;
    delete block;
    std::deque<Block> evicted;
    {
      std::lock_guard<std::mutex> guard(mu_);
      if (b.bytes > limit_) {
        evicted.push_back(b);
      } else {
        while (cached_ + b.bytes > limit_ && !free_.empty()) {  // oldest first
          evicted.push_back(free_.front());
          cached_ -= free_.front().bytes;
          free_.pop_front();
        }
        free_.push_back(b);
        cached_ += b.bytes;
      }
    }
    for (const Block& e : evicted) std::free(e.ptr);
  }

  std::mutex mu_;
  std::deque<Block> free_;  // oldest first
  size_t cached_ = 0, hits_ = 0, misses_ = 0, limit_ = 0;
};

// A contiguous CPU tensor of ``like``'s sizes and dtype whose buffer comes from the cache.
inline at::Tensor empty_output(const at::Tensor& like) {
  return at::detail::empty_generic(like.sizes(), &OutputCache::instance(),
                                   c10::DispatchKeySet(c10::DispatchKey::CPU), like.scalar_type(), c10::nullopt);
}

}  // namespace normfold
