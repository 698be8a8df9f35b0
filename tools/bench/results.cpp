// tools/bench/results.cpp — result table, JSON and markdown output.
#include "bench/results.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gmoe/error.h"

namespace gmoe::bench {

ResultRow timed_row(const std::string& case_name, const std::string& pass, const std::string& impl,
                    const std::string& dtype, double ms, double flops, std::optional<bool> correct, std::string note) {
  ResultRow r;
  r.case_name = case_name;
  r.pass = pass;
  r.impl = impl;
  r.dtype = dtype;
  r.ms = ms;
  r.tflops = ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0;
  r.correct = correct;
  r.note = std::move(note);
  return r;
}

ResultRow skipped_row(const std::string& case_name, const std::string& pass, const std::string& impl,
                      const std::string& dtype, const std::string& reason) {
  ResultRow r = timed_row(case_name, pass, impl, dtype, 0, 0);
  r.skipped = reason;
  return r;
}

namespace {

// Rows grouped by (case, pass) in first-seen order, with the impls in first-seen order.
struct Grouped {
  std::vector<std::pair<std::string, std::string>> keys;
  std::vector<std::string> impls;
  std::map<std::pair<std::string, std::string>, std::map<std::string, const ResultRow*>> cells;
};

Grouped group(const std::vector<ResultRow>& rows) {
  Grouped g;
  for (const ResultRow& r : rows) {
    const auto key = std::make_pair(r.case_name, r.pass);
    if (g.cells.find(key) == g.cells.end()) g.keys.push_back(key);
    g.cells[key][r.impl] = &r;
    bool known = false;
    for (const auto& i : g.impls) known |= i == r.impl;
    if (!known) g.impls.push_back(r.impl);
  }
  return g;
}

std::string fmt(double v, int prec = 1) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

bool is_layer_row(const ResultRow& r) { return r.impl == "gmoe_linear"; }
bool is_moe_row(const ResultRow& r) { return r.kind == "moe"; }
bool is_offload_row(const ResultRow& r) { return r.kind == "offload"; }
// mlp cases: GroupedMLP (gmoe) and its unfused composition (gmoe_unfused), passes forward and
// forward_backward (the gemm cases' gmoe rows are fprop, dgrad, wgrad).
bool is_mlp_row(const ResultRow& r) {
  return (r.impl == "gmoe" || r.impl == "gmoe_unfused") && (r.pass == "forward" || r.pass == "forward_backward");
}

// The table as text lines: header, one line per case/pass, then geometric means of gmoe's ratios.
// The GEMM rows, or (mlp) the rows of mlp cases, each with geomeans of its own; layer rows are left
// to layer_table.
std::vector<std::vector<std::string>> table(const std::vector<ResultRow>& all_rows, bool mlp) {
  std::vector<ResultRow> rows;
  for (const ResultRow& r : all_rows) {
    // FP8 layer rows and the activation-alone rows are bench/report.py's (they compare with other
    // rows of their own kind, not with gmoe's).
    if (r.impl.rfind("gmoe_linear_", 0) == 0 || r.impl == "gmoe_activation" || is_moe_row(r) || is_offload_row(r)) {
      continue;
    }
    if (!is_layer_row(r) && is_mlp_row(r) == mlp) rows.push_back(r);
  }
  if (rows.empty()) return {};
  const Grouped g = group(rows);
  std::vector<std::string> baselines;
  for (const auto& i : g.impls) {
    if (i != "gmoe") baselines.push_back(i);
  }
  std::vector<std::vector<std::string>> out;
  std::vector<std::string> head = {"case", "pass"};
  for (const auto& i : g.impls) head.push_back(i + " TFLOP/s");
  for (const auto& b : baselines) head.push_back("gmoe/" + b);
  head.push_back("correct");
  out.push_back(head);
  std::map<std::string, std::pair<double, int>> log_sum;
  for (const auto& key : g.keys) {
    const auto& cell = g.cells.at(key);
    std::vector<std::string> line = {key.first, key.second};
    for (const auto& i : g.impls) {
      auto it = cell.find(i);
      line.push_back(it == cell.end()        ? "-"
                     : it->second->skipped ? "skipped"
                                           : fmt(it->second->tflops, it->second->tflops < 10 ? 3 : 1));
    }
    auto gm = cell.find("gmoe");
    for (const auto& b : baselines) {
      auto it = cell.find(b);
      if (gm == cell.end() || it == cell.end() || it->second->tflops <= 0 || gm->second->tflops <= 0) {
        line.push_back("-");
        continue;
      }
      const double ratio = gm->second->tflops / it->second->tflops;
      line.push_back(fmt(ratio, 2) + "x");
      log_sum[b].first += std::log(ratio);
      log_sum[b].second += 1;
    }
    line.push_back(gm == cell.end() || !gm->second->correct ? "-"
                                                            : (*gm->second->correct ? "yes" : "NO"));
    out.push_back(line);
  }
  if (!log_sum.empty()) {
    std::vector<std::string> line = {"geomean", ""};
    for (size_t i = 0; i < g.impls.size(); ++i) line.push_back("");
    for (const auto& b : baselines) {
      auto it = log_sum.find(b);
      line.push_back(it == log_sum.end() ? "-" : fmt(std::exp(it->second.first / it->second.second), 2) + "x");
    }
    line.push_back("");
    out.push_back(line);
  }
  return out;
}

double overhead(const ResultRow& r) { return r.bare_ms && *r.bare_ms > 0 ? r.ms / *r.bare_ms - 1 : 0; }

// The layer rows: the layer's time beside the bare GEMMs of the same work measured in the same run,
// the overhead (layer / bare - 1), and what one call launches; then the geometric-mean overhead of
// each pass.
std::vector<std::vector<std::string>> layer_table(const std::vector<ResultRow>& all_rows) {
  std::vector<std::vector<std::string>> out;
  out.push_back({"case", "pass", "gmoe_linear TFLOP/s", "ms", "bare GEMMs ms", "overhead", "kernels", "memsets",
                 "memcpys", "correct"});
  std::vector<std::string> passes;                        // first-seen order
  std::map<std::string, std::pair<double, int>> log_sum;  // per pass: Σ log(layer / bare), count
  for (const ResultRow& r : all_rows) {
    if (!is_layer_row(r)) continue;
    if (r.skipped) {
      out.push_back({r.case_name, r.pass, "skipped", "-", "-", "-", "-", "-", "-", "-"});
      continue;
    }
    std::vector<std::string> line = {r.case_name, r.pass, fmt(r.tflops, r.tflops < 10 ? 3 : 1), fmt(r.ms, 3)};
    if (r.bare_ms && *r.bare_ms > 0) {
      line.push_back(fmt(*r.bare_ms, 3));
      line.push_back(fmt(100 * overhead(r), 1) + "%");
      if (log_sum.find(r.pass) == log_sum.end()) passes.push_back(r.pass);
      log_sum[r.pass].first += std::log(r.ms / *r.bare_ms);
      log_sum[r.pass].second += 1;
    } else {
      line.insert(line.end(), {"-", "-"});
    }
    if (r.launches) {
      line.insert(line.end(), {std::to_string(r.launches->kernels), std::to_string(r.launches->memsets),
                               std::to_string(r.launches->memcpys)});
    } else {
      line.insert(line.end(), {"-", "-", "-"});
    }
    line.push_back(!r.correct ? "-" : (*r.correct ? "yes" : "NO"));
    out.push_back(line);
  }
  if (out.size() == 1) return {};
  for (const std::string& p : passes) {
    const auto& [sum, n] = log_sum.at(p);
    out.push_back({"geomean", p, "", "", "", fmt(100 * (std::exp(sum / n) - 1), 1) + "%", "", "", "", ""});
  }
  return out;
}

std::string opt(const std::optional<double>& v, int prec) { return v ? fmt(*v, prec) : "-"; }

// The MoE layer's rows (impl gmoe: eager calls; gmoe_graph: the captured pass replayed;
// gmoe_keep_input: the layer keeping its permuted rows) and its phases alone (gmoe_router,
// gmoe_permute, gmoe_experts, gmoe_combine, forward_backward): time, TFLOP/s of the expert GEMMs,
// peak memory beyond inputs and weights, bytes kept for backward per token, launches per call.
std::vector<std::vector<std::string>> moe_table(const std::vector<ResultRow>& all_rows) {
  std::vector<std::vector<std::string>> out;
  out.push_back({"case", "pass", "impl", "ms", "TFLOP/s", "peak MiB", "kept B/token", "kernels", "correct"});
  for (const ResultRow& r : all_rows) {
    if (!is_moe_row(r) || r.gbps) continue;
    if (r.skipped) {
      out.push_back({r.case_name, r.pass, r.impl, "skipped", "-", "-", "-", "-", "-"});
      continue;
    }
    out.push_back({r.case_name, r.pass, r.impl, fmt(r.ms, 3), fmt(r.tflops, r.tflops < 10 ? 3 : 1), opt(r.peak_mib, 1),
                   opt(r.kept_bytes_per_token, 0), r.launches ? std::to_string(r.launches->kernels) : "-",
                   !r.correct ? "-" : (*r.correct ? "yes" : "NO")});
  }
  return out.size() > 1 ? out : std::vector<std::vector<std::string>>{};
}

// Permute and combine (forward and backward) alone: their bandwidth against a plain device copy's
// in the same run (the target: at least 80%).
std::vector<std::vector<std::string>> moe_copy_table(const std::vector<ResultRow>& all_rows) {
  std::vector<std::vector<std::string>> out;
  out.push_back({"case", "op", "pass", "ms", "GB/s", "copy GB/s", "of copy"});
  for (const ResultRow& r : all_rows) {
    if (!is_moe_row(r) || !r.gbps || r.skipped) continue;
    const bool ratio = r.copy_gbps && *r.copy_gbps > 0;
    out.push_back({r.case_name, r.impl, r.pass, fmt(r.ms, 3), fmt(*r.gbps, 0), opt(r.copy_gbps, 0),
                   ratio ? fmt(100 * *r.gbps / *r.copy_gbps, 1) + "%" : "-"});
  }
  return out.size() > 1 ? out : std::vector<std::vector<std::string>>{};
}

// Offload mode: times in ms (its rows count no FLOPs), the copies' bandwidth against the plain
// pinned copy's, and the memory of the steps with and without offloading.
std::vector<std::vector<std::string>> offload_table(const std::vector<ResultRow>& all_rows) {
  std::vector<std::vector<std::string>> out;
  out.push_back({"case", "pass", "impl", "ms", "GB/s", "of pinned copy", "activations MiB", "peak MiB",
                 "offloaded MiB", "correct"});
  for (const ResultRow& r : all_rows) {
    if (!is_offload_row(r)) continue;
    if (r.skipped) {
      out.push_back({r.case_name, r.pass, r.impl, "skipped", "-", "-", "-", "-", "-", "-"});
      continue;
    }
    const bool ratio = r.gbps && r.copy_gbps && *r.copy_gbps > 0;
    out.push_back({r.case_name, r.pass, r.impl, fmt(r.ms, 3), opt(r.gbps, 1),
                   ratio ? fmt(100 * *r.gbps / *r.copy_gbps, 1) + "%" : "-", opt(r.activations_mib, 1),
                   opt(r.peak_mib, 1), opt(r.offloaded_mib, 1), !r.correct ? "-" : (*r.correct ? "yes" : "NO")});
  }
  return out.size() > 1 ? out : std::vector<std::vector<std::string>>{};
}

void print_text(const std::vector<std::vector<std::string>>& t) {
  if (t.empty()) return;
  std::vector<size_t> width(t[0].size(), 0);
  for (const auto& line : t) {
    for (size_t c = 0; c < line.size(); ++c) width[c] = std::max(width[c], line[c].size());
  }
  for (size_t r = 0; r < t.size(); ++r) {
    std::string s;
    for (size_t c = 0; c < t[r].size(); ++c) {
      const std::string& cell = t[r][c];
      const std::string pad(width[c] - cell.size(), ' ');
      s += (c < 2 ? cell + pad : pad + cell) + (c + 1 < t[r].size() ? "  " : "");
    }
    std::printf("%s\n", s.c_str());
    if (r == 0) std::printf("%s\n", std::string(s.size(), '-').c_str());
  }
  std::fflush(stdout);
}

void write_markdown_table(std::ofstream& out, const std::vector<std::vector<std::string>>& t) {
  for (size_t r = 0; r < t.size(); ++r) {
    out << "|";
    for (const auto& cell : t[r]) out << " " << cell << " |";
    out << "\n";
    if (r == 0) {
      out << "|";
      for (size_t c = 0; c < t[r].size(); ++c) out << (c < 2 ? "---|" : "---:|");
      out << "\n";
    }
  }
}

// "case impl: reason", once per case, impl and reason (a skipped case skips all its passes).
std::vector<std::string> skipped_lines(const std::vector<ResultRow>& rows) {
  std::vector<std::string> out;
  for (const ResultRow& r : rows) {
    if (!r.skipped) continue;
    const std::string line = r.case_name + " " + r.impl + ": " + *r.skipped;
    if (std::find(out.begin(), out.end(), line) == out.end()) out.push_back(line);
  }
  return out;
}

}  // namespace

void print_table(const std::vector<ResultRow>& rows) {
  const auto main = table(rows, false), mlp = table(rows, true), layer = layer_table(rows);
  print_text(main);
  if (!mlp.empty()) {
    if (!main.empty()) std::printf("\n");
    std::printf("GroupedMLP (gmoe) and the composition of separate public ops (gmoe_unfused), same run:\n");
    print_text(mlp);
  }
  if ((!main.empty() || !mlp.empty()) && !layer.empty()) std::printf("\n");
  if (!layer.empty()) {
    std::printf("GroupedLinear (grouped bias, f32 main_grad accumulated) vs its bare GEMMs, same run:\n");
    print_text(layer);
  }
  const auto moe = moe_table(rows), moe_copy = moe_copy_table(rows);
  if (!moe.empty()) {
    std::printf("\nMoELayer (router top-k, permute, GroupedMLP, combine; TFLOP/s of the expert GEMMs):\n");
    print_text(moe);
  }
  if (!moe_copy.empty()) {
    std::printf("\nPermute and combine alone against a device copy, same run:\n");
    print_text(moe_copy);
  }
  const auto offload = offload_table(rows);
  if (!offload.empty()) {
    std::printf("\nActivation offloading (a stack of GroupedMLPs, one step with and without; the offloader's "
                "copies against a plain pinned copy):\n");
    print_text(offload);
  }
  const std::vector<std::string> skipped = skipped_lines(rows);
  if (!skipped.empty()) std::printf("\nSkipped (not run):\n");
  for (const std::string& s : skipped) std::printf("  %s\n", s.c_str());
}

void write_json(const std::string& path, const RunInfo& info, const std::vector<ResultRow>& rows) {
  nlohmann::json j;
  j["gpu"] = info.gpu;
  j["commit"] = info.commit;
  j["date"] = info.date;
  j["suite"] = info.suite;
  j["rows"] = nlohmann::json::array();
  for (const ResultRow& r : rows) {
    nlohmann::json jr = {{"case", r.case_name}, {"pass", r.pass}, {"impl", r.impl}, {"dtype", r.dtype}};
    jr["ms"] = r.skipped ? nlohmann::json(nullptr) : nlohmann::json(r.ms);
    jr["tflops"] = r.skipped ? nlohmann::json(nullptr) : nlohmann::json(r.tflops);
    jr["correct"] = r.correct ? nlohmann::json(*r.correct) : nlohmann::json(nullptr);
    if (r.skipped) jr["skipped"] = *r.skipped;
    if (!r.note.empty()) jr["note"] = r.note;
    if (r.bare_ms) {
      jr["bare_ms"] = *r.bare_ms;
      jr["overhead"] = overhead(r);
    }
    if (r.native_alone_ms) jr["native_alone_ms"] = *r.native_alone_ms;
    if (!r.kind.empty()) jr["kind"] = r.kind;
    if (r.peak_mib) jr["peak_mib"] = *r.peak_mib;
    if (r.kept_bytes_per_token) jr["kept_bytes_per_token"] = *r.kept_bytes_per_token;
    if (r.gbps) jr["gbps"] = *r.gbps;
    if (r.copy_gbps) jr["copy_gbps"] = *r.copy_gbps;
    if (r.activations_mib) jr["activations_mib"] = *r.activations_mib;
    if (r.offloaded_mib) jr["offloaded_mib"] = *r.offloaded_mib;
    if (r.launches) {
      jr["launches"] = r.launches->kernels;
      jr["graph_nodes"] = {{"kernel", r.launches->kernels}, {"memset", r.launches->memsets},
                           {"memcpy", r.launches->memcpys}, {"mem_alloc", r.launches->allocs},
                           {"mem_free", r.launches->frees}, {"other", r.launches->other}};
    }
    j["rows"].push_back(jr);
  }
  std::ofstream out(path);
  GMOE_CHECK(out.good(), "cannot write '", path, "'");
  out << j.dump(1) << "\n";
}

void write_markdown(const std::string& path, const RunInfo& info, const std::vector<ResultRow>& rows) {
  std::ofstream out(path);
  GMOE_CHECK(out.good(), "cannot write '", path, "'");
  out << "# gmoe-bench: suite " << info.suite << " on " << info.gpu << "\n\n"
      << "commit " << info.commit << ", " << info.date << ". TFLOP/s (median), and gmoe's ratio to "
      << "each baseline measured in the same run.\n\n";
  if (info.gpu == "cpu") {
    out << "CPU reference backend on rows scaled down: a correctness and smoke run. Its times and TFLOP/s "
        << "are not performance figures.\n\n";
  }
  write_markdown_table(out, table(rows, false));
  const auto mlp = table(rows, true);
  if (!mlp.empty()) {
    out << "\nExpert MLP (mlp cases; stacked weights, no bias, f32 main_grad accumulated, x kept by reference): "
        << "GroupedMLP (gmoe) and the composition of separate public ops (gmoe_unfused).\n\n";
    write_markdown_table(out, mlp);
  }
  const auto layer = layer_table(rows);
  if (!layer.empty()) {
    out << "\nGroupedLinear (grouped bias, f32 main_grad accumulated): its time beside the bare GEMMs of the "
        << "same work in the same run, the overhead, and what one call launches (CUDA graph capture).\n\n";
    write_markdown_table(out, layer);
  }
  const auto moe = moe_table(rows), moe_copy = moe_copy_table(rows);
  if (!moe.empty()) {
    out << "\nMoELayer (router top-k, permute, GroupedMLP, combine): time, TFLOP/s of the expert GEMMs, peak "
        << "memory beyond inputs and weights, bytes kept for backward per token, kernels per call.\n\n";
    write_markdown_table(out, moe);
  }
  if (!moe_copy.empty()) {
    out << "\nPermute and combine alone: bytes read and written per second against a plain device copy in the "
        << "same run.\n\n";
    write_markdown_table(out, moe_copy);
  }
  const auto offload = offload_table(rows);
  if (!offload.empty()) {
    out << "\nActivation offloading: one training step of a stack of GroupedMLPs without (gmoe_stack) and with "
        << "offloading (gmoe_stack_offload: the last layer kept on the device; gmoe_stack_offload_all: every layer "
        << "offloaded), in ms, with the memory the activations hold after forward, the "
        << "step's peak and the bytes offloaded; the offloader's copies alone against a plain pinned copy of the "
        << "same bytes.\n\n";
    write_markdown_table(out, offload);
  }
  const std::vector<std::string> skipped = skipped_lines(rows);
  if (!skipped.empty()) out << "\nSkipped (not run):\n\n";
  for (const std::string& s : skipped) out << "- " << s << "\n";
}

}  // namespace gmoe::bench
