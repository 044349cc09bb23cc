// A step team (step_team.h): the OpenMP threads started once for a step, the helpers spinning on
// one slot for the leader's parallel calls.
#include "step_team.h"

#include <c10/util/ParallelGuard.h>
#include <omp.h>
#include <pthread.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvserve {

struct StepTeam {
  // The number of the posted job, bumped by the leader; each helper waits for it to change.
  alignas(64) std::atomic<uint64_t> posted{0};
  // The posted job, written by the leader before `posted` is bumped.
  const void* fn = nullptr;
  team_detail::Chunk chunk = nullptr;
  int64_t begin = 0, end = 0, chunk_size = 0, num_chunks = 0;
  bool closing = false;  // the job that ends the helpers' wait
  // Chunks the helpers have finished, counted over the team's life (on a line of its own: the
  // helpers write it, the leader spins on it; never reset, so the leader's wait is the only
  // transfer of the line back per job); `awaited` is the count the leader waits for.
  alignas(64) std::atomic<int64_t> finished{0};
  int64_t awaited = 0;
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first chunk's exception, written by whoever set `failed`
  int64_t size = 1;          // threads, the leader included (read by the leader only)
  // Threads blocked (past their spin) on `posted` (helpers) or `finished` (the leader): the
  // writer of each wakes them.
  alignas(64) std::atomic<int> helpers_asleep{0};
  std::atomic<int> leader_asleep{0};
};

namespace {

std::atomic<bool> g_enabled{true};  // set_step_teams
std::atomic<int64_t> g_formed{0};  // teams formed so far (tests)
std::mutex g_team_mutex;           // one team at a time (another caller runs without one)
StepTeam g_team;
thread_local StepTeam* t_led = nullptr;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// How long a waiting thread spins before it blocks. The waits inside a step are microseconds
// (a kernel call, the leader's serial code between calls); a longer one means a thread that
// lost its core, or a leader stalled outside the kernels, and then a spinning thread would only
// take the core from the one it waits for.
constexpr auto kSpinBudget = std::chrono::microseconds(200);

// Waits until `value` differs from `seen` and returns it: spins, then blocks (atomic::wait)
// counted in `asleep`, which the writer checks after its write (write_and_wake). Both sides'
// write-then-read are sequentially consistent, so either the writer sees the sleeper or the
// sleeper sees the write before it blocks.
template <typename T>
T await_change(const std::atomic<T>& value, T seen, std::atomic<int>& asleep) {
  const auto start = std::chrono::steady_clock::now();
  for (int64_t spins = 1;; ++spins) {
    const T now = value.load(std::memory_order_acquire);
    if (now != seen) return now;
    relax();
    if (spins % 256 == 0 && std::chrono::steady_clock::now() - start > kSpinBudget) break;
  }
  asleep.fetch_add(1, std::memory_order_seq_cst);
  T now;
  while ((now = value.load(std::memory_order_seq_cst)) == seen) value.wait(seen, std::memory_order_seq_cst);
  asleep.fetch_sub(1, std::memory_order_relaxed);
  return now;
}

template <typename T>
void write_and_wake(std::atomic<T>& value, T add, std::atomic<int>& asleep) {
  value.fetch_add(add, std::memory_order_seq_cst);
  if (asleep.load(std::memory_order_seq_cst) > 0) value.notify_all();
}

// Chunk `tid` of the posted job, as at::parallel_for runs a chunk (its thread number and the
// parallel-region flag set); an exception is kept for the leader.
void run_chunk(StepTeam& team, int64_t tid) noexcept {
  if (tid >= team.num_chunks) return;
  const int64_t begin = team.begin + tid * team.chunk_size;
  if (begin >= team.end) return;
  try {
    at::internal::ThreadIdGuard thread_id(static_cast<int>(tid));
    c10::ParallelGuard in_parallel(true);
    team.chunk(team.fn, begin, std::min(team.end, begin + team.chunk_size));
  } catch (...) {
    if (!team.failed.exchange(true)) team.error = std::current_exception();
  }
}

// A helper's side of the region: each posted job's chunk `tid`, until the closing job.
void help(StepTeam& team, int64_t tid) {
  uint64_t seen = 0;
  for (;;) {
    seen = await_change(team.posted, seen, team.helpers_asleep);
    if (team.closing) return;
    run_chunk(team, tid);
    write_and_wake(team.finished, int64_t{1}, team.leader_asleep);
  }
}

// A process forked while a team ran (another thread leading it) starts with no team: its one
// thread leads none, and the mutex that thread's parent may have held is fresh.
void reset_in_child() {
  new (&g_team_mutex) std::mutex();
  t_led = nullptr;
}

const int g_atfork_registered = pthread_atfork(nullptr, nullptr, &reset_in_child);

// Clears t_led when the leader's chunk ends, however it ends.
struct NotLeading {
  explicit NotLeading(StepTeam& team) : team(team) { t_led = nullptr; }
  ~NotLeading() { t_led = &team; }
  StepTeam& team;
};

}  // namespace

namespace team_detail {

StepTeam* led_team() { return t_led; }

void run_chunks(StepTeam& team, int64_t begin, int64_t end, int64_t grain, const void* fn, Chunk chunk) {
  // at::parallel_for's split (ATen/ParallelOpenMP.h): min(threads, ceil(n / grain)) chunks of
  // ceil(n / chunks), chunk i on thread i.
  const int64_t n = end - begin;
  int64_t chunks = team.size;
  if (grain > 0) chunks = std::min(chunks, (n + grain - 1) / grain);
  team.fn = fn;
  team.chunk = chunk;
  team.begin = begin;
  team.end = end;
  team.num_chunks = chunks;
  team.chunk_size = (n + chunks - 1) / chunks;
  team.awaited += team.size - 1;
  write_and_wake(team.posted, uint64_t{1}, team.helpers_asleep);
  {
    const NotLeading not_leading(team);  // the leader's chunk runs as a helper's: nested calls inline
    run_chunk(team, 0);
  }
  int64_t done = team.finished.load(std::memory_order_acquire);
  while (done != team.awaited) done = await_change(team.finished, done, team.leader_asleep);
  if (team.failed.load(std::memory_order_relaxed)) {
    std::exception_ptr error = team.error;
    team.error = nullptr;
    team.failed.store(false, std::memory_order_relaxed);
    std::rethrow_exception(error);
  }
}

}  // namespace team_detail

void run_in_step_team(const std::function<void()>& body, bool allowed) {
  const int threads = at::get_num_threads();
  if (!allowed || !g_enabled.load(std::memory_order_relaxed) || t_led != nullptr || at::in_parallel_region() ||
      threads < 2) {
    body();
    return;
  }
  std::unique_lock<std::mutex> lock(g_team_mutex, std::try_to_lock);
  if (!lock.owns_lock()) {
    body();
    return;
  }
  StepTeam& team = g_team;
  team.posted.store(0, std::memory_order_relaxed);
  team.finished.store(0, std::memory_order_relaxed);
  team.awaited = 0;
  team.closing = false;
  team.failed.store(false, std::memory_order_relaxed);
  team.error = nullptr;
  std::exception_ptr error;
  bool formed = false;
  // No num_threads clause, as ATen's own regions (GOMP's thread pool, pytorch#32008). The team
  // forms only where the region has the threads at::parallel_for would use and the kernels
  // inside see that many (OMP_DYNAMIC, a thread limit or a nested thread count could say
  // otherwise); else the body runs after the region, without a team.
#pragma omp parallel
  {
    const int64_t tid = omp_get_thread_num();
    if (tid == 0) {
      formed = omp_get_num_threads() == threads && omp_get_max_threads() == threads;
      if (formed) {
        g_formed.fetch_add(1, std::memory_order_relaxed);
        team.size = threads;
        t_led = &team;
        try {
          body();
        } catch (...) {
          error = std::current_exception();
        }
        t_led = nullptr;
      }
      team.closing = true;
      write_and_wake(team.posted, uint64_t{1}, team.helpers_asleep);
    } else {
      help(team, tid);
    }
  }
  if (error) std::rethrow_exception(error);
  if (!formed) {
    lock.unlock();
    body();
  }
}

void set_step_teams(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

bool step_teams_enabled() { return g_enabled.load(std::memory_order_relaxed); }

int64_t step_teams_formed() { return g_formed.load(std::memory_order_relaxed); }

// Tests: which thread ran each index of [0, n) when a team ran parallel_for(0, n, grain), and
// when at::parallel_for did (-1: none). `throw_on` >= 0: the chunk holding that index throws;
// `throw_after`: the body throws after its parallel call, outside any chunk. `nested`: each
// chunk runs its indices through a nested parallel_for. `require_team`: fail where no team
// formed (teams on, two threads or more, no other caller leading one).
std::pair<std::vector<int64_t>, std::vector<int64_t>> step_team_probe(int64_t n, int64_t grain, int64_t throw_on,
                                                                      bool throw_after, bool nested,
                                                                      bool require_team) {
  std::vector<int64_t> in_team(n, -1), plain(n, -1);
  const auto record = [&](std::vector<int64_t>& ran, int64_t b, int64_t e) {
    const auto mark = [&](int64_t b2, int64_t e2) {
      for (int64_t i = b2; i < e2; ++i) ran[i] = omp_get_thread_num();
    };
    if (nested) kvserve::parallel_for(b, e, 1, mark);
    else mark(b, e);
  };
  at::parallel_for(0, n, grain, [&](int64_t b, int64_t e) { record(plain, b, e); });
  run_in_step_team([&] {
    TORCH_CHECK(!require_team || team_detail::led_team() != nullptr, "no team formed");
    kvserve::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      TORCH_CHECK(throw_on < b || throw_on >= e, "chunk [", b, ", ", e, ") of thread ", omp_get_thread_num(),
                  " threw");
      record(in_team, b, e);
    });
    TORCH_CHECK(!throw_after, "the body threw after its parallel call");
  });
  return {in_team, plain};
}

// Benchmarks: seconds per call of `calls` parallel_for(0, 2, 1) with an empty body (a store per
// chunk, to a line of its own), in one team or each call its own OpenMP region.
double step_team_empty_call_seconds(int64_t calls, bool teamed) {
  struct alignas(64) Slot {
    int64_t value = 0;
  };
  std::vector<Slot> slots(2);
  const auto body = [&] {
    for (int64_t c = 0; c < calls; ++c)
      kvserve::parallel_for(0, 2, 1, [&](int64_t b, int64_t e) { slots[b].value += e - b; });
  };
  const auto t0 = std::chrono::steady_clock::now();
  if (teamed) run_in_step_team(body);
  else body();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / calls;
}

}  // namespace kvserve
