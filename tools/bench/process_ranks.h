// tools/bench/process_ranks.h — one process per GPU for the NCCL programs (gmoe_tests_ep,
// gmoe-ep-bench): the GPU count asked in a probe child, and the ranks forked and reaped.
//
// The parent never initialises CUDA (a forked child cannot use a CUDA driver its parent
// initialised), so it makes the NCCL unique ids first and forks the ranks afterwards.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

namespace gmoe::bench {

/// The visible GPUs, asked in a probe child so that this process never initialises CUDA.
inline int count_gpus_in_child(const std::function<int()>& device_count) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int n = device_count();
    _exit(n > 100 ? 100 : n < 0 ? 0 : n);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

/// Forks `ranks` children, child r exiting with child(r), and waits for them; returns each one's
/// exit status (128 + signal when killed by one). A failed rank can leave its peers waiting at a
/// device barrier: past `deadline`, or 30 s after the first failure, the rest are killed (status
/// 124, with a line naming the rank after `name`).
inline std::vector<int> run_ranks(int ranks, const std::function<int(int)>& child, std::chrono::seconds deadline,
                                  const char* name) {
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(child(r));
    pids.push_back(pid);
  }
  using clock = std::chrono::steady_clock;
  const auto end = clock::now() + deadline;
  auto grace = clock::time_point::max();
  std::vector<int> result(static_cast<size_t>(ranks), -1);
  int left = ranks;
  while (left > 0) {
    for (int r = 0; r < ranks; ++r) {
      if (result[r] != -1) continue;
      int status = 0;
      if (waitpid(pids[r], &status, WNOHANG) == pids[r]) {
        result[r] = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        --left;
        if (result[r] != 0 && grace == clock::time_point::max()) grace = clock::now() + std::chrono::seconds(30);
      }
    }
    if (left > 0 && (clock::now() > end || clock::now() > grace)) {
      for (int r = 0; r < ranks; ++r) {
        if (result[r] != -1) continue;
        std::fprintf(stderr, "%s: rank %d hung; killed\n", name, r);
        kill(pids[r], SIGKILL);
        waitpid(pids[r], nullptr, 0);
        result[r] = 124;
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return result;
}

}  // namespace gmoe::bench
