// tools/bench/results.cpp — result table, JSON and markdown output.
#include "bench/results.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gmoe/error.h"

namespace gmoe::bench {
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

// The table as text lines: header, one line per case/pass, then geometric means of gmoe's ratios.
std::vector<std::vector<std::string>> table(const std::vector<ResultRow>& rows) {
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
      line.push_back(it == cell.end() ? "-" : fmt(it->second->tflops, it->second->tflops < 10 ? 3 : 1));
    }
    auto gm = cell.find("gmoe");
    for (const auto& b : baselines) {
      auto it = cell.find(b);
      if (gm == cell.end() || it == cell.end() || it->second->tflops <= 0) {
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

}  // namespace

void print_table(const std::vector<ResultRow>& rows) {
  const auto t = table(rows);
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

void write_json(const std::string& path, const RunInfo& info, const std::vector<ResultRow>& rows) {
  nlohmann::json j;
  j["gpu"] = info.gpu;
  j["commit"] = info.commit;
  j["date"] = info.date;
  j["suite"] = info.suite;
  j["rows"] = nlohmann::json::array();
  for (const ResultRow& r : rows) {
    nlohmann::json jr = {{"case", r.case_name}, {"pass", r.pass}, {"impl", r.impl},
                         {"dtype", r.dtype},    {"ms", r.ms},     {"tflops", r.tflops}};
    jr["correct"] = r.correct ? nlohmann::json(*r.correct) : nlohmann::json(nullptr);
    if (!r.note.empty()) jr["note"] = r.note;
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
  const auto t = table(rows);
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

}  // namespace gmoe::bench
