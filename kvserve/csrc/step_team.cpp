// A step team (step_team.h): the OpenMP threads started once for a step, the helpers spinning on
// one slot for the leader's parallel calls.
#include "step_team.h"

#include <omp.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
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
};

namespace {

bool enabled_from_environment() {
  const char* value = std::getenv("KVSERVE_STEP_TEAM");
  return !(value && std::strcmp(value, "0") == 0);
}

std::atomic<bool> g_enabled{enabled_from_environment()};
std::mutex g_team_mutex;  // one team at a time (another caller runs without one)
StepTeam g_team;
thread_local StepTeam* t_led = nullptr;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

// Spins on `ready`: the waits inside a step are microseconds. Past ~1 ms of pauses (a helper
// descheduled, a leader in a long serial stretch) it yields the core instead.
template <typename Ready>
void spin_until(const Ready& ready) {
  for (int64_t spins = 0; !ready(); ++spins) {
    if (spins < (int64_t{1} << 14)) relax();
    else std::this_thread::yield();
  }
}

void run_chunk(StepTeam& team, int64_t tid) {
  if (tid >= team.num_chunks) return;
  const int64_t begin = team.begin + tid * team.chunk_size;
  if (begin >= team.end) return;
  try {
    team.chunk(team.fn, begin, std::min(team.end, begin + team.chunk_size));
  } catch (...) {
    if (!team.failed.exchange(true)) team.error = std::current_exception();
  }
}

// A helper's side of the region: each posted job's chunk `tid`, until the closing job.
void help(StepTeam& team, int64_t tid) {
  uint64_t seen = 0;
  for (;;) {
    uint64_t job = seen;
    spin_until([&] { return (job = team.posted.load(std::memory_order_acquire)) != seen; });
    seen = job;
    if (team.closing) return;
    run_chunk(team, tid);
    team.finished.fetch_add(1, std::memory_order_release);
  }
}

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
  team.posted.fetch_add(1, std::memory_order_release);
  t_led = nullptr;  // the leader's chunk runs as a helper's: its nested parallel calls inline
  run_chunk(team, 0);
  t_led = &team;
  spin_until([&] { return team.finished.load(std::memory_order_acquire) == team.awaited; });
  if (team.failed.load(std::memory_order_relaxed)) {
    std::exception_ptr error = team.error;
    team.error = nullptr;
    team.failed.store(false, std::memory_order_relaxed);
    std::rethrow_exception(error);
  }
}

}  // namespace team_detail

void run_in_step_team(const std::function<void()>& body) {
  if (!g_enabled.load(std::memory_order_relaxed) || t_led != nullptr || at::in_parallel_region() ||
      at::get_num_threads() < 2) {
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
  // No num_threads clause, as ATen's own regions (GOMP's thread pool, pytorch#32008): the team
  // is the at::get_num_threads() threads that at::parallel_for would use.
#pragma omp parallel
  {
    const int64_t tid = omp_get_thread_num();
    if (tid == 0) {
      team.size = omp_get_num_threads();
      t_led = team.size > 1 ? &team : nullptr;
      try {
        body();
      } catch (...) {
        error = std::current_exception();
      }
      t_led = nullptr;
      team.closing = true;
      team.posted.fetch_add(1, std::memory_order_release);
    } else {
      help(team, tid);
    }
  }
  if (error) std::rethrow_exception(error);
}

void set_step_teams(bool enabled) { g_enabled.store(enabled, std::memory_order_relaxed); }

bool step_teams_enabled() { return g_enabled.load(std::memory_order_relaxed); }

namespace {

// Tests: which thread ran each index of [0, n) when a team ran parallel_for(0, n, grain), and
// when at::parallel_for did (-1: none); `throw_on` >= 0 makes the chunk holding that index
// throw, inside the team. `nested`: each chunk runs its indices through a nested parallel_for.
std::pair<std::vector<int64_t>, std::vector<int64_t>> probe_chunks(int64_t n, int64_t grain, int64_t throw_on,
                                                                   bool nested) {
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
    TORCH_CHECK(team_detail::led_team() != nullptr || at::get_num_threads() < 2 || !step_teams_enabled(),
                "no team formed");
    kvserve::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
      TORCH_CHECK(throw_on < b || throw_on >= e, "chunk [", b, ", ", e, ") of thread ", omp_get_thread_num(),
                  " threw");
      record(in_team, b, e);
    });
  });
  return {in_team, plain};
}

// Benchmarks: seconds per call of `calls` parallel_for(0, 2, 1) with an empty body (a store per
// chunk, to a line of its own), in one team or each call its own OpenMP region.
double empty_call_seconds(int64_t calls, bool teamed) {
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

}  // namespace

void register_step_team(pybind11::module& m) {
  m.def("set_step_teams", &set_step_teams,
        "One parallel region per fused decoder step (kvserve::run_in_step_team) or one per kernel call");
  m.def("step_teams_enabled", &step_teams_enabled);
  m.def("step_team_empty_call_seconds", &empty_call_seconds, "benchmarks: an empty parallel call's cost");
  m.def("step_team_probe", &probe_chunks, "tests: the thread of each index in a team and in at::parallel_for",
        pybind11::arg("n"), pybind11::arg("grain"), pybind11::arg("throw_on") = -1, pybind11::arg("nested") = false);
}

}  // namespace kvserve
