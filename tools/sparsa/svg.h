// A small SVG plotter for `bench` and `demo`: a line plot (linear or log axes, one
// line per series, ticks, legend) and a bar chart of one or more panels. The output
// is a self-contained SVG document that browsers and image viewers open directly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparsa/status.h"

namespace sparsa::cli {

struct Series {
  std::string name;
  std::vector<double> x, y;  // non-positive values are skipped on a log axis
};

struct LinePlot {
  std::string title, x_label, y_label;
  bool log_x = false, log_y = false;
  std::vector<Series> series;
};

struct BarPanel {
  std::string y_label;
  std::vector<double> values;  // one per category; NaN draws no bar
  bool log_y = false;          // zero and negative values draw no bar on a log axis
};

struct BarChart {
  std::string title;
  std::vector<std::string> categories;
  std::vector<BarPanel> panels;  // side by side
};

std::string render_svg(const LinePlot& plot);
std::string render_svg(const BarChart& chart);

// Tick positions for an axis over [lo, hi] (data units): "nice" 1-2-5 steps on a
// linear axis, powers of ten (with 2 and 5 when the range is short) on a log axis.
std::vector<double> axis_ticks(double lo, double hi, bool log_axis);

// Writes text to a file; the message names `what` (the flag) on failure.
Status write_text_file(const std::string& what, const std::string& path, const std::string& text);

}  // namespace sparsa::cli
