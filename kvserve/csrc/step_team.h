// One parallel region for a whole decode step instead of one per kernel call.
//
// A single-stream decode step makes ~180 parallel calls (4 linear layers and attention per
// layer, 30 layers) of 10-20 us each. Through OpenMP each pays a fork and a join, ~1.1-1.3 us
// measured on Zen 4: ~0.2 ms of a 3.4 ms int4 SmolLM2 step. In a step team the OpenMP threads
// are started once for the step (`run_in_step_team`): the calling thread runs the step's code,
// the others wait on a spin slot, and each kernel's `kvserve::parallel_for` posts its chunks to
// them through that slot.
//
// kvserve::parallel_for splits a range exactly as at::parallel_for does (the same chunks on the
// same thread numbers), so a kernel's results do not depend on whether a team ran it. Outside a
// team, or inside one of its chunks, it is at::parallel_for. Torch ops called inside a team run
// on one thread (ATen sees a parallel region): a team is only for code whose parallel work goes
// through kvserve::parallel_for.
#pragma once

#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

namespace kvserve {

struct StepTeam;

namespace team_detail {
using Chunk = void (*)(const void* fn, int64_t begin, int64_t end);
// The team this thread leads (null outside a team and in its helpers).
StepTeam* led_team();
// Runs fn's chunks of [begin, end) on the team's threads (the leader takes chunk 0), the chunks
// at::parallel_for would make; rethrows the first chunk's exception.
void run_chunks(StepTeam& team, int64_t begin, int64_t end, int64_t grain, const void* fn, Chunk chunk);
}  // namespace team_detail

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  StepTeam* team = team_detail::led_team();
  if (team == nullptr || end - begin <= grain || end - begin <= 1) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  team_detail::run_chunks(*team, begin, end, grain, &f, [](const void* fn, int64_t b, int64_t e) {
    (*static_cast<const F*>(fn))(b, e);
  });
}

// Runs body on this thread with the other OpenMP threads as its team for kvserve::parallel_for.
// Runs it plainly (no team) where the caller does not allow one (`allowed`: every parallel call
// in body goes through kvserve::parallel_for), where teams are off, with one thread, inside a
// parallel region, or while another thread leads the team.
void run_in_step_team(const std::function<void()>& body, bool allowed = true);

// Teams on or off for the process (on by default; the engine sets it at start-up from its
// settings, tests and A/B runs switch it).
void set_step_teams(bool enabled);
bool step_teams_enabled();

// Tests and benchmarks (bound in bindings.cpp): how many teams have formed in this process; which
// thread ran each index of a team's parallel_for and of at::parallel_for's (step_team.cpp); the
// cost of an empty parallel call in a team or in its own OpenMP region.
int64_t step_teams_formed();
std::pair<std::vector<int64_t>, std::vector<int64_t>> step_team_probe(int64_t n, int64_t grain, int64_t throw_on,
                                                                      bool throw_after, bool nested,
                                                                      bool require_team);
double step_team_empty_call_seconds(int64_t calls, bool teamed);

}  // namespace kvserve
