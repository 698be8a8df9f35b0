// tools/gmoe_ckpt.cpp — gmoe-ckpt: look into and convert safetensors checkpoints of expert layers.
//
//   gmoe-ckpt inspect FILE                       tensors (dtype, shape, bytes) and, per expert
//                                                parameter, the layout found and any problem
//   gmoe-ckpt inspect --brief FILE               expert parameters collapsed to one line each
//   gmoe-ckpt convert IN OUT --layout per-expert stacked ↔ per-expert (IN may be an index json)
//   gmoe-ckpt convert IN OUT --glu fc1 --glu-from concat --glu-to interleaved:8
//   gmoe-ckpt bench-header --tensors 12500 25000 50000 100000
//                                                times parsing headers of that many tensors
//
// Expert parameters are keys with an `experts` component whose parameter component is `weight`
// or `bias` (stacked) or `weight<e>` / `bias<e>` (per-expert); --scope and --param change that.
// Exit status: 0 on success, 1 on a checkpoint problem (the message says which file, key and why),
// 130 when interrupted (the output is then left as it was: no partial or temporary file).
//
// Everything printed that comes from a file (key names, metadata, messages naming them) goes
// through ckpt_detail::printable, so a hostile checkpoint cannot write terminal escapes.
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/internal.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace {

using gmoe::ckpt_detail::printable;

// Set by SIGINT/SIGTERM/SIGHUP; the conversion's progress callback sees it and throws, so the
// writer unwinds and removes its temporary file.
volatile std::sig_atomic_t g_interrupted = 0;
void on_signal(int) { g_interrupted = 1; }

std::string human_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int inspect(const std::string& path, const gmoe::ExpertDetectOptions& detect, bool brief) {
  const gmoe::Checkpoint ckpt = gmoe::Checkpoint::open(path);
  uint64_t total = 0;
  for (const std::string& k : ckpt.keys()) total += ckpt.entry(k).nbytes();
  std::printf("%s: %zu file(s), %zu tensors, %s of tensor data\n", printable(path).c_str(),
              ckpt.files().size(), ckpt.keys().size(), human_bytes(total).c_str());
  for (const auto& kv : ckpt.metadata()) {
    std::printf("  metadata %s = %s\n", printable(kv.first).c_str(), printable(kv.second).c_str());
  }

  const std::vector<gmoe::DetectedExpertParam> params = gmoe::detect_expert_params(ckpt, detect);
  std::map<std::string, std::string> layout_of;  // key → its expert-layout column
  std::set<std::string> grouped;
  for (const auto& d : params) {
    for (const std::string& k : d.keys) {
      grouped.insert(k);
      if (!d.problem.empty()) {
        layout_of[k] = "INVALID";
      } else if (d.info.layout == gmoe::ExpertLayout::stacked) {
        layout_of[k] = "stacked E=" + std::to_string(d.info.num_experts);
      } else {
        layout_of[k] = "per-expert of " + std::to_string(d.info.num_experts);
      }
    }
  }

  size_t width = 3;
  for (const std::string& k : ckpt.keys()) width = std::max(width, printable(k).size());
  width = std::min<size_t>(width, 72);
  std::printf("\n%-*s  %-7s  %-22s  %10s  %s\n", static_cast<int>(width), "key", "dtype", "shape", "bytes",
              "expert layout");
  for (const std::string& k : ckpt.keys()) {
    if (brief && grouped.count(k) && layout_of[k].rfind("per-expert", 0) == 0) continue;
    const gmoe::SafetensorsEntry& e = ckpt.entry(k);
    auto it = layout_of.find(k);
    std::printf("%-*s  %-7s  %-22s  %10s  %s\n", static_cast<int>(width), printable(k).c_str(),
                e.dtype_code.c_str(), shape_str(e.shape).c_str(), human_bytes(e.nbytes()).c_str(),
                it == layout_of.end() ? "-" : it->second.c_str());
  }

  std::printf("\nexpert parameters: %zu\n", params.size());
  int bad = 0;
  std::set<int64_t> counts;
  for (const auto& d : params) {
    if (!d.problem.empty()) {
      ++bad;
      std::printf("  %-*s  PROBLEM: %s\n", static_cast<int>(width),
                  printable(d.key.stacked_key()).c_str(), printable(d.problem).c_str());
      continue;
    }
    counts.insert(d.info.num_experts);
    const std::string name = d.info.layout == gmoe::ExpertLayout::stacked
                                 ? d.key.stacked_key()
                                 : d.key.stem + "<e>" + d.key.suffix;
    std::printf("  %-*s  %-10s  E=%-4lld  expert %s %s\n", static_cast<int>(width),
                printable(name).c_str(),
                gmoe::expert_layout_name(d.info.layout), static_cast<long long>(d.info.num_experts),
                d.info.dtype_code.c_str(), shape_str(d.info.expert_shape).c_str());
  }
  if (counts.size() > 1) {
    std::printf("  note: expert parameters disagree on the number of experts\n");
  }
  return bad ? 1 : 0;
}

// Progress on stderr: at most a few updates a second, only for large outputs or a terminal.
struct Progress {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now(), last{};
  bool tty = isatty(2) != 0;
  bool shown = false;

  void operator()(uint64_t done, uint64_t total, const std::string& key) {
    const auto now = std::chrono::steady_clock::now();
    const bool final = done == total;
    if (!final && now - last < std::chrono::milliseconds(tty ? 200 : 2000)) return;
    if (!tty && total < (256ull << 20)) return;  // small jobs stay quiet in logs
    last = now;
    shown = true;
    const double secs = std::chrono::duration<double>(now - start).count();
    const double pct = total ? 100.0 * static_cast<double>(done) / static_cast<double>(total) : 100.0;
    std::fprintf(stderr, "%s%5.1f%%  %s / %s  %.0f MiB/s  %s%s", tty ? "\r\033[K" : "", pct,
                 human_bytes(done).c_str(), human_bytes(total).c_str(),
                 secs > 0 ? static_cast<double>(done) / (1 << 20) / secs : 0.0, printable(key).c_str(),
                 tty ? "" : "\n");
    if (final && tty) std::fprintf(stderr, "\n");
  }
};

// Thrown from the progress callback once a signal arrived.
struct Interrupted {};

// A header text of n F32 [1] tensors named like a real MoE checkpoint's experts.
std::vector<uint8_t> synthetic_file(int64_t n) {
  std::string h = "{\"__metadata__\":{\"format\":\"pt\"}";
  for (int64_t i = 0; i < n; ++i) {
    h += ",\"model.layers." + std::to_string(i / 256) + ".mlp.experts." + std::to_string(i % 256) +
         ".down_proj.weight\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[" +
         std::to_string(4 * i) + "," + std::to_string(4 * i + 4) + "]}";
  }
  h += "}";
  std::vector<uint8_t> file(8);
  for (int i = 0; i < 8; ++i) file[static_cast<size_t>(i)] = static_cast<uint8_t>(h.size() >> (8 * i));
  file.insert(file.end(), h.begin(), h.end());
  file.resize(file.size() + static_cast<size_t>(4 * n), 0);
  return file;
}

int bench_header(const std::vector<int64_t>& sizes, int repeat) {
  std::printf("%10s  %12s  %10s  %12s\n", "tensors", "header", "parse", "per tensor");
  for (int64_t n : sizes) {
    if (n < 0 || repeat < 1) {
      std::fprintf(stderr, "gmoe-ckpt: --tensors must be >= 0 and --repeat >= 1\n");
      return 1;
    }
    const std::vector<uint8_t> file = synthetic_file(n);
    std::vector<double> secs;
    for (int r = 0; r < repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const gmoe::SafetensorsHeader h = gmoe::parse_safetensors(file.data(), file.size(), "bench");
      secs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (static_cast<int64_t>(h.tensors.size()) != n) return 1;
    }
    std::sort(secs.begin(), secs.end());
    const double med = secs[secs.size() / 2];
    std::printf("%10lld  %12s  %8.3f s  %9.2f us\n", static_cast<long long>(n),
                human_bytes(file.size()).c_str(), med, n ? med * 1e6 / static_cast<double>(n) : 0.0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gmoe-ckpt: inspect and convert safetensors checkpoints of MoE expert layers"};
  app.require_subcommand(1);

  gmoe::ExpertDetectOptions detect;
  auto add_detect = [&](CLI::App* sub) {
    sub->add_option("--scope", detect.scope_components,
                    "key components marking expert parameters (default: experts); '' = every key")
        ->expected(1, -1);
    sub->add_option("--param", detect.param_names,
                    "parameter names that take the expert index (default: weight bias)")
        ->expected(1, -1);
  };

  CLI::App* ins = app.add_subcommand("inspect", "list tensors and the expert layout of each parameter");
  std::string ins_path;
  bool brief = false;
  ins->add_option("FILE", ins_path, "a .safetensors file or an index .json")->required();
  ins->add_flag("--brief", brief, "one line per per-expert parameter instead of one per expert");
  add_detect(ins);

  CLI::App* conv = app.add_subcommand("convert", "rewrite a checkpoint in another expert / gate-up layout");
  std::string in, out, layout = "keep", glu_from = "concat", glu_to = "concat";
  std::vector<std::string> glu_stems;
  int64_t num_experts = -1;
  bool quiet = false;
  conv->add_option("IN", in, "a .safetensors file or an index .json")->required();
  conv->add_option("OUT", out, "the .safetensors file to write")->required();
  conv->add_option("--layout", layout, "stacked, per-expert, or keep (default)")
      ->check(CLI::IsMember({"stacked", "per-expert", "keep"}));
  conv->add_option("--glu", glu_stems,
                   "convert gate/up of expert parameters whose key stem contains this (e.g. fc1)");
  conv->add_option("--glu-from", glu_from, "gate/up layout in IN: concat or interleaved:BLOCK");
  conv->add_option("--glu-to", glu_to, "gate/up layout in OUT: concat or interleaved:BLOCK");
  conv->add_option("--num-experts", num_experts, "expected number of experts (checked)");
  conv->add_flag("--quiet", quiet, "no progress output");
  add_detect(conv);

  CLI::App* bench = app.add_subcommand(
      "bench-header", "time parsing safetensors headers of N tensors (in memory; median of --repeat)");
  std::vector<int64_t> bench_sizes{12500, 25000, 50000, 100000};
  int bench_repeat = 3;
  bench->add_option("--tensors", bench_sizes, "tensor counts to time")->expected(1, -1);
  bench->add_option("--repeat", bench_repeat, "runs per count (the median is reported)");

  CLI11_PARSE(app, argc, argv);
  if (*bench) return bench_header(bench_sizes, bench_repeat);
  // --scope '' means every key is in scope.
  if (std::find(detect.scope_components.begin(), detect.scope_components.end(), "") !=
      detect.scope_components.end()) {
    detect.scope_components.clear();
  }
  try {
    if (*ins) return inspect(ins_path, detect, brief);
    gmoe::ConvertOptions opt;
    opt.detect = detect;
    opt.change_layout = layout != "keep";
    opt.layout = layout == "stacked" ? gmoe::ExpertLayout::stacked : gmoe::ExpertLayout::per_expert;
    opt.num_experts = num_experts;
    opt.glu_stems = glu_stems;
    opt.glu_from = gmoe::glu_format_from_string(glu_from);
    opt.glu_to = gmoe::glu_format_from_string(glu_to);
    Progress progress;
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_signal);
    opt.progress = [&](uint64_t d, uint64_t t, const std::string& k) {
      if (g_interrupted) throw Interrupted();
      if (!quiet) progress(d, t, k);
    };
    gmoe::convert_checkpoint(in, out, opt);
    std::printf("wrote %s\n", printable(out).c_str());
    return 0;
  } catch (const Interrupted&) {
    std::fprintf(stderr, "\ngmoe-ckpt: interrupted; %s left as it was\n", printable(out).c_str());
    return 130;
  } catch (const gmoe::Error& e) {
    std::fprintf(stderr, "gmoe-ckpt: %s\n", printable(e.what()).c_str());
    return 1;
  }
}
