// tools/gmoe_ckpt.cpp — gmoe-ckpt: look into and convert safetensors checkpoints of expert layers.
//
//   gmoe-ckpt inspect FILE                       the convention found (Mixtral, Qwen2/3-MoE, OLMoE,
//                                                DeepSeek, gpt-oss, Megatron-Core, gmoe), its MoE
//                                                layers and experts, each expert tensor's layout,
//                                                orientation and GLU form; then every tensor
//   gmoe-ckpt convert IN OUT --to gmoe           into another convention (keys named, experts
//                                                stacked, gate/up fused, [out, in] as gmoe loads)
//   gmoe-ckpt convert IN OUT --layout stacked --gate-up fused --glu-to interleaved:8
//                                                layout and gate/up form within a convention
//   gmoe-ckpt convert IN OUT --to mixtral --dry-run
//                                                prints the plan of keys, writes nothing
//   gmoe-ckpt bench-header --tensors 12500 25000 50000 100000
//                                                times parsing headers of that many tensors
//
// Conventions are recognised from key names and shapes with no flags. For other key names,
// --scope / --param name the expert parameters explicitly (keys with an `experts` component whose
// parameter component is `weight<e>` / `bias<e>`, or the stacked `weight` / `bias`), and --glu
// STEM converts gate/up of those whose stem contains STEM.
// Exit status: 0 on success, 1 on a checkpoint problem (the message says which file, key and why;
// --verbose adds where in gmoe's sources it was found), 2 on a usage error, 130 when interrupted
// (the output is then left as it was: no partial or temporary file). OUT may not be the input
// (or one of its files) unless --overwrite-input is given.
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
#include <optional>
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

std::string user_message(const std::string& what, bool verbose) {
  // gmoe::Error reads "file:line: check `expr` failed: message"; users get the message.
  if (verbose) return what;
  const size_t check = what.find(": check `");
  const size_t failed = check == std::string::npos ? check : what.find("` failed: ", check);
  return failed == std::string::npos ? what : what.substr(failed + 10);
}

std::string glu_column(const gmoe::MoeBlock& b, const gmoe::MoeExpertTensor& t) {
  using R = gmoe::MoeTensorRole;
  if (!b.gated) return t.role == R::fc1 || t.role == R::fc1_bias ? "not gated" : "-";
  switch (t.role) {
    case R::fc1:
    case R::fc1_bias: return "gate/up " + gmoe::glu_format_name(t.glu);
    case R::gate:
    case R::gate_bias: return "gate (separate)";
    case R::up:
    case R::up_bias: return "up (separate)";
    default: return "-";
  }
}

// The convention, its blocks and their tensors; returns the number of problems.
int print_convention(const gmoe::MoeCheckpointInfo& rec, std::map<std::string, std::string>* column) {
  for (const std::string& p : rec.problems) std::printf("PROBLEM: %s\n", printable(p).c_str());
  if (rec.blocks.empty()) return static_cast<int>(rec.problems.size());
  std::set<int64_t> experts, layers;
  for (const auto& b : rec.blocks) experts.insert(b.num_experts);
  std::printf("convention: %s (%s), %zu MoE layer(s)", gmoe::moe_convention_name(rec.convention),
              rec.family.c_str(), rec.blocks.size());
  if (experts.size() == 1) std::printf(", %lld experts each", static_cast<long long>(*experts.begin()));
  std::printf("\n");
  for (const auto& b : rec.blocks) {
    std::printf("\nlayer %s  %s  E=%lld H=%lld F=%lld  %s\n",
                b.layer >= 0 ? std::to_string(b.layer).c_str() : "-", printable(b.module).c_str(),
                static_cast<long long>(b.num_experts), static_cast<long long>(b.hidden),
                static_cast<long long>(b.ffn),
                !b.gated ? "FC1 not gated" : b.separate_gate_up ? "gate/up separate" : "gate/up fused");
    for (const auto& t : b.tensors) {
      const std::string name = t.info.layout == gmoe::ExpertLayout::stacked
                                   ? t.key.stacked_key()
                                   : t.key.stem + "{0.." + std::to_string(t.info.num_experts - 1) + "}" + t.key.suffix;
      const bool weight = t.info.expert_shape.size() == 2;
      std::printf("  %-9s %-10s  %-9s  %-22s  %-5s %s  %s\n", gmoe::moe_tensor_role_name(t.role),
                  gmoe::expert_layout_name(t.info.layout),
                  weight ? gmoe::weight_orientation_name(t.orientation) : "", glu_column(b, t).c_str(),
                  t.info.dtype_code.c_str(), shape_str(t.info.expert_shape).c_str(), printable(name).c_str());
      for (const std::string& k : t.keys) {
        (*column)[k] = std::string(gmoe::moe_tensor_role_name(t.role)) + " " +
                       (t.info.layout == gmoe::ExpertLayout::stacked ? "stacked E=" : "expert of ") +
                       std::to_string(t.info.num_experts);
      }
    }
    for (const auto& kv : b.router) {
      std::printf("  %-22s  %s\n", kv.first.c_str(), printable(kv.second).c_str());
      (*column)[kv.second] = kv.first;
    }
    for (const auto& kv : b.shared) {
      std::printf("  shared %-15s  %s\n", kv.first.c_str(), printable(kv.second).c_str());
      (*column)[kv.second] = "shared " + kv.first;
    }
  }
  return static_cast<int>(rec.problems.size());
}

int inspect(const std::string& path, const gmoe::ExpertDetectOptions& detect, bool generic, bool brief,
            const std::optional<gmoe::GluFormat>& glu_from) {
  const gmoe::Checkpoint ckpt = gmoe::Checkpoint::open(path);
  uint64_t total = 0;
  for (const std::string& k : ckpt.keys()) total += ckpt.entry(k).nbytes();
  std::printf("%s: %zu file(s), %zu tensors, %s of tensor data\n", printable(path).c_str(),
              ckpt.files().size(), ckpt.keys().size(), human_bytes(total).c_str());
  for (const auto& kv : ckpt.metadata()) {
    std::printf("  metadata %s = %s\n", printable(kv.first).c_str(), printable(kv.second).c_str());
  }

  std::map<std::string, std::string> layout_of;  // key → its expert-layout column
  int bad = 0;
  const gmoe::MoeCheckpointInfo rec =
      generic ? gmoe::MoeCheckpointInfo{} : gmoe::recognise_moe_checkpoint(ckpt, glu_from ? &*glu_from : nullptr);
  const bool conventions = !generic && (rec.recognised || !rec.problems.empty());
  std::vector<gmoe::DetectedExpertParam> params;
  if (conventions) {
    std::printf("\n");
    bad += print_convention(rec, &layout_of);
  } else {
    params = gmoe::detect_expert_params(ckpt, detect);
    for (const auto& d : params) {
      for (const std::string& k : d.keys) {
        if (!d.problem.empty()) {
          layout_of[k] = "INVALID";
        } else if (d.info.layout == gmoe::ExpertLayout::stacked) {
          layout_of[k] = "stacked E=" + std::to_string(d.info.num_experts);
        } else {
          layout_of[k] = "per-expert of " + std::to_string(d.info.num_experts);
        }
      }
    }
  }

  size_t width = 3;
  for (const std::string& k : ckpt.keys()) width = std::max(width, printable(k).size());
  width = std::min<size_t>(width, 72);
  std::printf("\n%-*s  %-7s  %-22s  %10s  %s\n", static_cast<int>(width), "key", "dtype", "shape", "bytes",
              "expert layout");
  for (const std::string& k : ckpt.keys()) {
    auto it = layout_of.find(k);
    if (brief && it != layout_of.end() &&
        (it->second.rfind("per-expert", 0) == 0 || it->second.find("expert of") != std::string::npos)) {
      continue;
    }
    const gmoe::SafetensorsEntry& e = ckpt.entry(k);
    std::printf("%-*s  %-7s  %-22s  %10s  %s\n", static_cast<int>(width), printable(k).c_str(),
                e.dtype_code.c_str(), shape_str(e.shape).c_str(), human_bytes(e.nbytes()).c_str(),
                it == layout_of.end() ? "-" : it->second.c_str());
  }
  if (conventions) return bad ? 1 : 0;

  std::printf("\nexpert parameters: %zu%s\n", params.size(),
              generic ? "" : " (no known convention recognised: keys under `experts` named weight<e> / bias<e>)");
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

void print_plan(const std::vector<gmoe::ConvertPlanEntry>& plan) {
  size_t width = 3;
  for (const auto& p : plan) width = std::max(width, printable(p.key).size());
  width = std::min<size_t>(width, 80);
  for (const auto& p : plan) {
    std::printf("%-*s  %-7s  %-22s  <- %s\n", static_cast<int>(width), printable(p.key).c_str(),
                p.dtype_code.c_str(), shape_str(p.shape).c_str(), printable(p.source).c_str());
  }
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
  app.fallthrough();
  bool verbose = false;
  app.add_flag("--verbose", verbose, "error messages with where in gmoe's sources they come from");

  gmoe::ExpertDetectOptions detect;
  std::vector<std::string> scope, param_names;
  auto add_detect = [&](CLI::App* sub) {
    sub->add_option("--scope", scope,
                    "generic mode: key components marking expert parameters (default: experts); '' = every key")
        ->expected(1, -1);
    sub->add_option("--param", param_names,
                    "generic mode: parameter names that take the expert index (default: weight bias)")
        ->expected(1, -1);
  };
  std::string glu_from = "", glu_to = "";

  CLI::App* ins = app.add_subcommand("inspect", "the convention, MoE layers and experts, and every tensor");
  std::string ins_path;
  bool brief = false;
  ins->add_option("FILE", ins_path, "a .safetensors file or an index .json")->required();
  ins->add_flag("--brief", brief, "per-expert tensors left out of the tensor list");
  ins->add_option("--glu-from", glu_from,
                  "gate/up layout of fused FC1 weights in FILE where neither its keys nor its metadata say it "
                  "(default: concat; or interleaved:BLOCK)");
  add_detect(ins);

  CLI::App* conv = app.add_subcommand("convert", "rewrite a checkpoint in another convention, layout, gate/up form, orientation or dtype");
  std::string in, out, to = "keep", layout = "keep", gate_up = "keep", orientation = "keep", dtype = "keep";
  std::vector<std::string> glu_stems;
  int64_t num_experts = -1;
  bool quiet = false, dry_run = false, overwrite = false;
  conv->add_option("IN", in, "a .safetensors file or an index .json")->required();
  conv->add_option("OUT", out, "the .safetensors file to write")->required();
  conv->add_option("--to", to, "convention to write: gmoe, mixtral, qwen, deepseek, gpt-oss, megatron, or keep (default)");
  conv->add_option("--layout", layout, "stacked, per-expert, or keep (default)")
      ->check(CLI::IsMember({"stacked", "per-expert", "keep"}));
  conv->add_option("--gate-up", gate_up, "separate (two tensors), fused (one FC1), or keep (default)")
      ->check(CLI::IsMember({"separate", "fused", "keep"}));
  conv->add_option("--orientation", orientation, "out-in ([out, in] as nn.Linear), in-out, or keep (default)")
      ->check(CLI::IsMember({"out-in", "in-out", "keep"}));
  conv->add_option("--dtype", dtype, "cast every f32/bf16/f16 tensor: f32, bf16, f16, or keep (default: bit-exact)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "keep"}));
  conv->add_option("--glu-from", glu_from,
                   "gate/up layout of fused FC1 in IN where neither its keys nor its metadata say it (default: "
                   "concat; or interleaved:BLOCK); generic mode: the layout --glu converts from");
  conv->add_option("--glu-to", glu_to, "gate/up layout of fused FC1 in OUT: concat or interleaved:BLOCK (implies "
                   "--gate-up fused unless given); generic mode: the layout --glu converts to");
  conv->add_option("--glu", glu_stems,
                   "generic mode: convert gate/up of expert parameters whose key stem contains this (e.g. fc1)");
  conv->add_option("--num-experts", num_experts, "generic mode: expected number of experts (checked)");
  conv->add_flag("--dry-run", dry_run, "print the plan of keys (what each output key comes from), write nothing");
  conv->add_flag("--overwrite-input", overwrite, "allow OUT to be IN (replaced through a temporary file)");
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
  const bool generic = !scope.empty() || !param_names.empty() || !glu_stems.empty() || num_experts >= 0;
  if (!scope.empty()) detect.scope_components = scope;
  if (!param_names.empty()) detect.param_names = param_names;
  // --scope '' means every key is in scope.
  if (std::find(detect.scope_components.begin(), detect.scope_components.end(), "") !=
      detect.scope_components.end()) {
    detect.scope_components.clear();
  }
  try {
    std::optional<gmoe::GluFormat> from, into;
    if (!glu_from.empty()) from = gmoe::glu_format_from_string(glu_from);
    if (!glu_to.empty()) into = gmoe::glu_format_from_string(glu_to);
    if (*ins) return inspect(ins_path, detect, generic, brief, from);
    Progress progress;
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, on_signal);
    const gmoe::ProgressFn on_progress = [&](uint64_t d, uint64_t t, const std::string& k) {
      if (g_interrupted) throw Interrupted();
      if (!quiet) progress(d, t, k);
    };
    const gmoe::Checkpoint ckpt = gmoe::Checkpoint::open(in);
    const gmoe::MoeCheckpointInfo rec =
        generic ? gmoe::MoeCheckpointInfo{} : gmoe::recognise_moe_checkpoint(ckpt, from ? &*from : nullptr);
    std::vector<gmoe::ConvertPlanEntry> plan;
    if (!generic && (rec.recognised || !rec.problems.empty())) {
      gmoe::MoeConvertOptions opt;
      if (to != "keep") opt.convention = gmoe::moe_convention_from_string(to);
      if (layout != "keep") opt.layout = layout == "stacked" ? gmoe::ExpertLayout::stacked : gmoe::ExpertLayout::per_expert;
      if (gate_up != "keep") opt.separate_gate_up = gate_up == "separate";
      if (into) {
        opt.glu = into;
        if (gate_up == "keep") opt.separate_gate_up = false;
      }
      if (orientation != "keep") {
        opt.orientation = orientation == "out-in" ? gmoe::WeightOrientation::out_in : gmoe::WeightOrientation::in_out;
      }
      if (dtype != "keep") opt.cast = dtype == "f32" ? gmoe::DType::f32 : dtype == "bf16" ? gmoe::DType::bf16 : gmoe::DType::f16;
      opt.glu_from = from;
      opt.allow_overwrite_input = overwrite;
      opt.dry_run = dry_run;
      opt.progress = on_progress;
      if (!dry_run) {
        std::printf("%s: %s (%s), %zu MoE layer(s) -> %s\n", printable(in).c_str(),
                    gmoe::moe_convention_name(rec.convention), rec.family.c_str(), rec.blocks.size(),
                    to == "keep" ? gmoe::moe_convention_name(rec.convention) : to.c_str());
      }
      plan = gmoe::convert_moe_checkpoint(in, out, opt);
    } else {
      if (to != "keep" || gate_up != "keep" || orientation != "keep" || dtype != "keep") {
        std::fprintf(stderr, "gmoe-ckpt: %s: %s\n", printable(in).c_str(),
                     generic ? "--to, --gate-up, --orientation and --dtype work on recognised conventions, "
                               "not with --scope/--param/--glu/--num-experts"
                             : "no known convention recognised (see `gmoe-ckpt inspect`); --to, --gate-up, "
                               "--orientation and --dtype need one");
        return 1;
      }
      gmoe::ConvertOptions opt;
      opt.detect = detect;
      opt.change_layout = layout != "keep";
      opt.layout = layout == "stacked" ? gmoe::ExpertLayout::stacked : gmoe::ExpertLayout::per_expert;
      opt.num_experts = num_experts;
      opt.glu_stems = glu_stems;
      opt.glu_from = from.value_or(gmoe::GluFormat{});
      opt.glu_to = into.value_or(gmoe::GluFormat{});
      opt.allow_overwrite_input = overwrite;
      opt.dry_run = dry_run;
      opt.progress = on_progress;
      if (!generic && gmoe::detect_expert_params(ckpt, detect).empty()) {
        std::fprintf(stderr, "gmoe-ckpt: %s: found no expert parameters (no known convention, nothing "
                     "under `experts` named weight<e> / bias<e>): nothing to convert; see `gmoe-ckpt "
                     "inspect` and --scope/--param\n", printable(in).c_str());
        return 1;
      }
      plan = gmoe::convert_checkpoint(in, out, opt);
    }
    if (dry_run) {
      print_plan(plan);
      std::printf("dry run: nothing written\n");
    } else {
      std::printf("wrote %s\n", printable(out).c_str());
    }
    return 0;
  } catch (const Interrupted&) {
    std::fprintf(stderr, "\ngmoe-ckpt: interrupted; %s left as it was\n", printable(out).c_str());
    return 130;
  } catch (const gmoe::Error& e) {
    std::fprintf(stderr, "gmoe-ckpt: %s\n", printable(user_message(e.what(), verbose)).c_str());
    return 1;
  }
}
