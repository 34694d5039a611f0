// How a product's threads share its items (panels, strips): each thread takes its own contiguous
// share in order, then what is left of the other threads' shares, from their ends.
//
// A thread reading one long stretch of memory keeps the hardware prefetcher streaming ahead of
// it; items handed to whichever thread asks next interleave the two threads' reads, so that every
// item starts a new stream. Shares fixed in advance would keep one thread waiting for the other
// whenever another process holds its core; taking from the others' ends prevents that.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace pagedserve {

// The items of one share not yet taken, [front, back), in one word: the owner taking from the
// front and another thread taking from the back can never both take the last one. Item numbers
// are below 2**32.
class Share {
 public:
  void reset(int64_t front, int64_t back) { bounds_.store(pack(front, back)); }

  int64_t take_front() { return take(1, 0); }  // -1 once none is left
  int64_t take_back() { return take(0, 1); }

 private:
  int64_t take(int64_t front_step, int64_t back_step) {
    uint64_t bounds = bounds_.load();
    while (front_of(bounds) < back_of(bounds)) {
      const uint64_t rest = pack(front_of(bounds) + front_step, back_of(bounds) - back_step);
      if (bounds_.compare_exchange_weak(bounds, rest)) {
        return front_step == 1 ? front_of(bounds) : back_of(bounds) - 1;
      }
    }
    return -1;
  }

  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  static int64_t front_of(uint64_t bounds) { return static_cast<int64_t>(bounds & 0xffffffffu); }
  static int64_t back_of(uint64_t bounds) { return static_cast<int64_t>(bounds >> 32); }

  std::atomic<uint64_t> bounds_{0};
};

// What one thread takes: its own share from the front, then the others' from their backs.
class SharedItems {
 public:
  SharedItems(std::vector<Share>& shares, int64_t thread) : shares_(shares), thread_(thread) {}

  int64_t next() {  // -1 once every item is taken
    const int64_t num_shares = static_cast<int64_t>(shares_.size());
    for (; offset_ < num_shares; ++offset_) {
      Share& share = shares_[(thread_ + offset_) % num_shares];
      const int64_t item = offset_ == 0 ? share.take_front() : share.take_back();
      if (item >= 0) return item;
    }
    return -1;
  }

 private:
  std::vector<Share>& shares_;
  int64_t thread_;
  int64_t offset_ = 0;  // the share taken from: the thread's own (0), then the following ones
};

// Runs worker(SharedItems&) once on each of at::get_num_threads() threads; between them they
// take every item in [0, num_items) exactly once. Which thread takes an item must not change
// what is computed from it.
template <typename Worker>
void share_items(int64_t num_items, Worker&& worker) {
  const int64_t threads =
      std::clamp<int64_t>(at::get_num_threads(), 1, std::max<int64_t>(num_items, 1));
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].reset(num_items * t / threads, num_items * (t + 1) / threads);
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t thread = begin; thread < end; ++thread) {
      SharedItems items(shares, thread);
      worker(items);
    }
  });
}

// share_items over strips of `width` output features: work(strip, its first feature, how many of
// its features are real, the last strip's padding left out).
template <typename Work>
void share_strips(int64_t num_strips, int64_t width, int64_t out_features, Work&& work) {
  share_items(num_strips, [&](SharedItems& strips) {
    for (int64_t s = strips.next(); s >= 0; s = strips.next()) {
      work(s, s * width, std::min(width, out_features - s * width));
    }
  });
}

}  // namespace pagedserve
