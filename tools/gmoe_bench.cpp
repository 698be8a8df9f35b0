// tools/gmoe_bench.cpp — gmoe-bench: runs a benchmark suite, checking correctness before timing.
//
//   gmoe-bench [--suite bench/suites/public.json] [--backend auto|cpu|cuda] [--mode gemm|layer|mlp|moe|all]
//              [--json F] [--markdown F] [--tuning SPEC]
//
// On a GPU (sm_90) it runs the CUDA backend on the suite as given, with the cuBLAS baselines in the
// same run. Without one it runs the CPU reference backend on a reduced suite: the same cases with
// rows scaled down (counts scaled keeping empty experts empty and the skew) so that the whole run
// takes about a minute. Modes: `gemm` times the three grouped GEMM passes of each gemm case; `layer`
// times GroupedLinear forward and forward+backward on the same cases beside its bare GEMMs, with the
// kernel launches per call (CUDA graph capture) and a check that they do not grow with E; `mlp`
// times GroupedMLP forward and forward+backward on the mlp cases beside the same work composed of
// separate public ops (impl gmoe_unfused); `moe` times MoELayer (router top-k, permute, GroupedMLP,
// combine) forward, backward and forward+backward on the moe cases, eager and replayed from CUDA
// graphs, with its peak memory and the bytes it keeps for backward per token, and permute and
// combine alone against a device copy (bench/moe_common.h); `all` (default) runs all four. On the
// CPU a moe case is also made narrower when its weights would not fit (scale_moe_for_cpu).
// --tuning overrides the
// kernel heuristics for the whole run (gmoe/tuning.h). A case that a runner
// cannot run (an unsupported combination, e.g. --fp8 where K is not a multiple of 16, or any error
// inside the case) becomes rows marked `skipped` with the reason, and the run goes on. Exits
// non-zero when any correctness check fails. On the CPU this is a correctness and smoke run: its
// times say nothing about performance.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "bench/fp8_runner.h"
#include "bench/layer_common.h"
#include "bench/offload_common.h"
#include "bench/results.h"
#include "bench/runner.h"
#include "bench/suite.h"
#include "gmoe/error.h"
#include "gmoe/tuning.h"

#ifndef GMOE_WITH_CUDA
namespace gmoe::bench {
bool cuda_available(std::string*) { return false; }
void release_cached_memory_cuda() {}
std::vector<ResultRow> run_gemm_case_cuda(const BenchCase&, const BenchOptions&) {
  GMOE_FAIL("gmoe-bench was built without CUDA");
}
std::vector<ResultRow> run_layer_case_cuda(const BenchCase&, const BenchOptions&) {
  GMOE_FAIL("gmoe-bench was built without CUDA");
}
bool check_layer_launches_cuda(const BenchOptions&) { GMOE_FAIL("gmoe-bench was built without CUDA"); }
std::vector<ResultRow> run_mlp_case_cuda(const BenchCase&, const BenchOptions&) {
  GMOE_FAIL("gmoe-bench was built without CUDA");
}
std::vector<ResultRow> run_moe_case_cuda(const BenchCase&, const BenchOptions&) {
  GMOE_FAIL("gmoe-bench was built without CUDA");
}
std::vector<ResultRow> run_fp8_gemm_case_cuda(const BenchCase&, const BenchOptions&, const Fp8BenchRecipe&) {
  GMOE_FAIL("gmoe-bench was built without CUDA");
}
Fp8BenchRecipe fp8_recipe_from_name(const std::string&) { GMOE_FAIL("gmoe-bench was built without CUDA"); }
}  // namespace gmoe::bench
#endif

namespace {

std::string today() {
  const std::time_t t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
  return buf;
}

// The rows of one runner on one case; an exception (an unsupported combination, or a failure inside
// the case) becomes one skipped row per pass the runner would have timed, with the reason, so that
// one case never loses the rest of the run and its JSON.
std::vector<gmoe::bench::ResultRow> run_or_skip(const std::function<std::vector<gmoe::bench::ResultRow>()>& run,
                                                const std::string& case_name, const std::string& impl,
                                                const std::string& dtype, const std::vector<std::string>& passes) {
  try {
    return run();
  } catch (const std::exception& e) {
    std::printf("  SKIPPED %s %s: %s\n", case_name.c_str(), impl.c_str(), e.what());
    std::vector<gmoe::bench::ResultRow> rows;
    for (const std::string& p : passes) rows.push_back(gmoe::bench::skipped_row(case_name, p, impl, dtype, e.what()));
    return rows;
  }
}

// False when a checked row is incorrect; prints each such row.
bool all_rows_correct(const std::vector<gmoe::bench::ResultRow>& rows) {
  bool ok = true;
  for (const gmoe::bench::ResultRow& row : rows) {
    if (row.correct && !*row.correct) {
      ok = false;
      std::printf("  INCORRECT %s %s %s: %s\n", row.case_name.c_str(), row.impl.c_str(), row.pass.c_str(),
                  row.note.c_str());
    }
  }
  return ok;
}

// The impl name of an FP8 recipe's gemm rows (fp8_runner.h).
std::string fp8_impl(const std::string& recipe) { return recipe == "mxfp8" ? "gmoe_mxfp8" : "gmoe_fp8_" + recipe; }

}  // namespace

int main(int argc, char** argv) {
  using namespace gmoe::bench;
  CLI::App app{"gmoe-bench: grouped GEMM and expert-layer benchmarks (correctness first, then timing)"};
  std::string suite_path = "bench/suites/public.json", backend = "auto", json_path, md_path, filter,
              dtype = "bf16", mode = "all";
  double cpu_gflop = 0.5, cpu_layer_gflop = 0.125, cpu_mlp_gflop = 0.25, cpu_moe_gflop = 0.05,
         cpu_moe_weight_mib = 64;
  BenchOptions o;
  bool no_baselines = false;
  app.add_option("--suite", suite_path, "suite file (format of bench/suites/public.json)");
  app.add_option("--backend", backend, "auto (CUDA when an sm_90 GPU is present), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  app.add_option("--dtype", dtype, "input dtype")->check(CLI::IsMember({"bf16", "f16"}));
  app.add_option("--mode", mode,
                 "gemm: the GEMM passes; layer: GroupedLinear beside its bare GEMMs; mlp: GroupedMLP beside its "
                 "unfused composition (mlp cases); moe: MoELayer, its memory, and permute / combine against a "
                 "device copy (moe cases); offload: a stack of 4 GroupedMLPs with and without activation "
                 "offloading (mlp cases); all: gemm, layer, mlp and moe")
      ->check(CLI::IsMember({"gemm", "layer", "mlp", "moe", "offload", "all"}));
  app.add_option("--case", filter, "only cases whose name contains this");
  app.add_option("--json", json_path, "write results as JSON (docs/benchmarks.md format)");
  app.add_option("--markdown", md_path, "write the table as markdown");
  app.add_option("--iters", o.iters, "timed runs per measurement (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "untimed runs before timing");
  app.add_option("--samples", o.samples, "sampled elements per correctness check");
  app.add_option("--seed", o.seed, "input seed");
  app.add_option("--cpu-gflop", cpu_gflop, "CPU backend: GFLOP per pass the rows are scaled to");
  app.add_option("--cpu-layer-gflop", cpu_layer_gflop, "CPU backend, layer mode: GFLOP per GEMM the rows are scaled to");
  app.add_option("--cpu-mlp-gflop", cpu_mlp_gflop, "CPU backend, mlp mode: GFLOP per forward the rows are scaled to");
  app.add_option("--cpu-moe-gflop", cpu_moe_gflop, "CPU backend, moe mode: GFLOP per forward the tokens are scaled to");
  app.add_option("--cpu-moe-weight-mib", cpu_moe_weight_mib,
                 "CPU backend, moe mode: hidden and ffn scaled down until the experts' weights fit this");
  app.add_option("--layer-fp8", o.layer_recipes,
                 "layer mode on CUDA: also GroupedLinear with these FP8 recipes (fp8_blockwise, fp8_tensorwise, "
                 "mxfp8; with '+native_wgrad' the weight gradient in bf16, with '+cached_weights' the weights "
                 "quantized once instead of before every forward; x's columnwise FP8 copy kept from forward, or with "
                 "'+requant_input' x by reference and quantized again in backward; '+pow2': power-of-two scales; "
                 "'+fast_accum': fprop and dgrad with fast accumulation), rows gmoe_linear_<recipe>, timed "
                 "interleaved with the native layer; mlp mode: GroupedMLP with the recipe on both FCs ('+quant_after_act': "
                 "z quantized after the activation instead of inside it)")
      ->delimiter(',')
      ->check([](const std::string& name) {
        try {
          gmoe::bench::bench_recipe_from_name(name);
          return std::string();
        } catch (const gmoe::Error& e) {
          return std::string(e.what());
        }
      });
  app.add_flag("--layer-copy-input", o.layer_copy_input,
               "layer mode: GroupedLinear copies x in forward (its default) instead of keeping a reference");
  app.add_flag("--no-baselines", no_baselines, "skip the cuBLAS baselines");
  std::vector<std::string> fp8_recipes;
  app.add_option("--fp8", fp8_recipes,
                 "gemm mode on CUDA: also the FP8 grouped GEMM with these recipes (blockwise, "
                 "tensorwise, mxfp8; blockwise_pow2, tensorwise_pow2: power-of-two scales; tensorwise_fast: fprop "
                 "and dgrad with fast accumulation), rows "
                 "gmoe_fp8_<recipe> / gmoe_mxfp8, dtype fp8")
      ->delimiter(',')
      ->check(CLI::IsMember({"blockwise", "tensorwise", "mxfp8", "blockwise_pow2", "tensorwise_pow2", "tensorwise_fast"}));
  std::string fp8_wgrad_out = "bf16";
  app.add_option("--fp8-wgrad-out", fp8_wgrad_out,
                 "FP8 gemm rows: dW dtype of the wgrad pass (bf16 as the bf16 row and torch write; f32: "
                 "the main_grad kernels)")
      ->check(CLI::IsMember({"bf16", "f32"}));
  std::string fp8_grad_format = "e4m3";
  app.add_option("--fp8-grad-format", fp8_grad_format,
                 "FP8 gemm rows: the format of dy in dgrad and wgrad (e5m2: rows gmoe_fp8_<recipe>_e5m2)")
      ->check(CLI::IsMember({"e4m3", "e5m2"}));
  app.add_flag("--mlp-main-grad", o.mlp_main_grad,
               "mlp mode: weight gradients accumulated in f32 into main_grads (Megatron) instead of fresh bf16 "
               "ones (as torch's autograd returns them)");
  app.add_option("--mlp-glu-block", o.mlp_glu_block,
                 "mlp mode: FC1's gate/up rows interleaved in blocks of this many (0: concatenated)");
  app.add_option("--warm-ms,--mlp-warm-ms", o.warm_ms,
                 "layer and mlp modes (CUDA): milliseconds of back-to-back untimed work before each timing, so "
                 "that it runs at the clocks of sustained load, as in training (an H100 at its 700 W cap runs "
                 "GEMMs near 1.5 GHz instead of 1.98); 0 times right after the warm-up runs. "
                 "bench/torch_baseline.py's --warm-ms does the same");
  app.add_option("--gemm-warm-ms", o.gemm_warm_ms,
                 "gemm mode (CUDA): milliseconds of back-to-back untimed work before each timing, as --warm-ms "
                 "(default 0: bursts)");
  std::string tuning;
  app.add_option("--tuning", tuning,
                 "kernel heuristic overrides for the whole run, gmoe::parse_tuning's syntax (e.g. "
                 "tile=coop,cluster=2x1,raster=n,row_chunk=256; keys tile, cluster, fp8_rows_cluster, raster, row_chunk)");
  app.add_option("--pass", o.only_pass, "gemm mode: only this pass (e.g. to profile one kernel)")
      ->check(CLI::IsMember({"fprop", "dgrad", "wgrad"}));
  CLI11_PARSE(app, argc, argv);
  o.fp8_wgrad_out = gmoe::dtype_from_name(fp8_wgrad_out);
  o.fp8_grad_format = gmoe::dtype_from_name(fp8_grad_format);
  o.baselines = !no_baselines;
  o.dtype = gmoe::dtype_from_name(dtype);

  try {
    const gmoe::ScopedTuning tuning_scope(gmoe::parse_tuning(tuning));
    const Suite suite = load_suite(suite_path);
    std::string gpu;
    const bool have_gpu = cuda_available(&gpu);
    GMOE_CHECK(backend != "cuda" || have_gpu, "--backend cuda: no sm_90 CUDA device is available");
    const bool use_cuda = backend == "cuda" || (backend == "auto" && have_gpu);
    if (!use_cuda) {
      o.iters = std::min(o.iters, 1);
      o.warmup = 0;
    }
    std::printf("gmoe-bench: suite %s (%zu cases) on %s\n", suite.name.c_str(), suite.cases.size(),
                use_cuda ? gpu.c_str()
                         : "the CPU reference backend, rows scaled down: a correctness and smoke run (its "
                           "times and TFLOP/s are not performance figures)");
    if (!tuning.empty()) std::printf("gmoe-bench: tuning %s\n", gmoe::tuning_spec(gmoe::current_tuning()).c_str());
    const bool run_gemm = mode == "gemm" || mode == "all", run_layer = mode == "layer" || mode == "all";
    const bool run_mlp = mode == "mlp" || mode == "all", run_moe = mode == "moe" || mode == "all";
    std::vector<ResultRow> rows;
    bool all_correct = true;
    const auto t0 = std::chrono::steady_clock::now();
    if (run_layer && use_cuda) {
      try {
        if (!check_layer_launches_cuda(o)) all_correct = false;
      } catch (const std::exception& e) {
        std::printf("  launch count check: SKIPPED: %s\n", e.what());
      }
    }
    const std::vector<std::string> layer_passes = {"forward", "forward_backward"};
    std::vector<std::string> gemm_passes;
    for (const char* p : {"fprop", "dgrad", "wgrad"}) {
      if (o.runs_pass(p)) gemm_passes.push_back(p);
    }
    for (const BenchCase& full : suite.cases) {
      if (!filter.empty() && full.name.find(filter) == std::string::npos) continue;
      if (use_cuda) release_cached_memory_cuda();
      if (mode == "offload") {
        if (full.kind != "mlp") continue;
        const std::vector<ResultRow> m = run_offload_mode(full, o, use_cuda, cpu_mlp_gflop, dtype);
        for (const ResultRow& row : m) all_correct = all_correct && (!row.correct || *row.correct);
        rows.insert(rows.end(), m.begin(), m.end());
        continue;
      }
      if (full.kind == "moe") {
        if (!run_moe) continue;
        const BenchCase cm = use_cuda ? full : scale_moe_for_cpu(full, cpu_moe_gflop, cpu_moe_weight_mib * 1024 * 1024);
        std::vector<ResultRow> m =
            run_or_skip([&] { return use_cuda ? run_moe_case_cuda(cm, o) : run_moe_case_cpu(cm, o); }, full.name,
                        "gmoe", dtype, {"forward", "backward", "forward_backward"});
        for (ResultRow& row : m) row.kind = "moe";  // skipped rows too
        all_correct = all_rows_correct(m) && all_correct;
        std::printf("  %-24s tokens %lld, top-%lld of E %lld, hidden %lld, ffn %lld, %s, %s routing: done\n",
                    cm.name.c_str(), (long long)cm.tokens, (long long)cm.top_k, (long long)cm.E, (long long)cm.hidden,
                    (long long)cm.ffn, cm.activation.c_str(), cm.routing.c_str());
        std::fflush(stdout);
        rows.insert(rows.end(), m.begin(), m.end());
        continue;
      }
      if (full.kind == "mlp") {
        if (!run_mlp) continue;
        BenchCase cm = full;
        const std::vector<ResultRow> m = run_or_skip(
            [&] {
              if (!use_cuda) cm = scale_rows(full, cpu_mlp_gflop * 1e9 / mlp_flops(full));
              return use_cuda ? run_mlp_case_cuda(cm, o) : run_mlp_case_cpu(cm, o);
            },
            full.name, "gmoe", dtype, layer_passes);
        all_correct = all_rows_correct(m) && all_correct;
        std::printf("  %-24s rows %lld, E %lld, hidden %lld, ffn %lld, %s: done\n", cm.name.c_str(),
                    (long long)cm.rows, (long long)cm.E, (long long)cm.hidden, (long long)cm.ffn,
                    cm.activation.c_str());
        std::fflush(stdout);
        rows.insert(rows.end(), m.begin(), m.end());
        continue;
      }
      if (!run_gemm && !run_layer) continue;
      const BenchCase c = use_cuda ? full : scale_rows(full, cpu_gflop * 1e9 / gemm_flops(full));
      std::vector<ResultRow> r;
      if (run_gemm) {
        r = run_or_skip([&] { return use_cuda ? run_gemm_case_cuda(c, o) : run_gemm_case_cpu(c, o); }, c.name,
                        "gmoe", dtype, gemm_passes);
        for (const std::string& recipe : fp8_recipes) {
          const std::vector<ResultRow> f = run_or_skip(
              [&] {
                if (!use_cuda) throw gmoe::Error("--fp8: the FP8 gemm rows run on the CUDA backend only");
                return run_fp8_gemm_case_cuda(c, o, fp8_recipe_from_name(recipe));
              },
              c.name, fp8_impl(recipe), "fp8", gemm_passes);
          r.insert(r.end(), f.begin(), f.end());
        }
      }
      if (run_layer) {
        const BenchCase cl = use_cuda ? full : scale_rows(full, cpu_layer_gflop * 1e9 / gemm_flops(full));
        const std::vector<ResultRow> l =
            run_or_skip([&] { return use_cuda ? run_layer_case_cuda(cl, o) : run_layer_case_cpu(cl, o); }, cl.name,
                        "gmoe_linear", dtype, layer_passes);
        r.insert(r.end(), l.begin(), l.end());
      }
      for (const ResultRow& row : r) {
        if (row.correct && !*row.correct) {
          all_correct = false;
          std::printf("  INCORRECT %s %s: %s\n", row.case_name.c_str(), row.pass.c_str(), row.note.c_str());
        }
      }
      std::printf("  %-24s rows %lld, E %lld, N %lld, K %lld: done\n", c.name.c_str(), (long long)c.rows,
                  (long long)c.E, (long long)c.N, (long long)c.K);
      std::fflush(stdout);
      rows.insert(rows.end(), r.begin(), r.end());
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("\n");
    print_table(rows);
    size_t skipped = 0;
    for (const ResultRow& row : rows) skipped += row.skipped ? 1 : 0;
    std::printf("\n%s in %.1f s; correctness: %s; %zu rows skipped\n",
                use_cuda ? "CUDA backend" : "CPU backend (correctness and smoke run, not a performance figure)", secs,
                all_correct ? "all checks passed" : "FAILURES (see above)", skipped);
    const char* commit = std::getenv("GMOE_COMMIT");
    const RunInfo info{use_cuda ? gpu : "cpu", commit ? commit : "unknown", today(), suite.name};
    if (!json_path.empty()) write_json(json_path, info, rows);
    if (!md_path.empty()) write_markdown(md_path, info, rows);
    return all_correct ? 0 : 1;
  } catch (const gmoe::Error& e) {
    std::fprintf(stderr, "gmoe-bench: %s\n", e.what());
    return 2;
  }
}
