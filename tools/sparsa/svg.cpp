#include "svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>

#include "util.h"

namespace sparsa::cli {

namespace {

const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                          "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
constexpr int kPaletteSize = sizeof(kPalette) / sizeof(kPalette[0]);

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default:
        // Control bytes are not allowed in XML 1.0.
        if (static_cast<unsigned char>(c) >= 0x20 || c == '\t') out += c;
    }
  }
  return out;
}

std::string num(double x) { return format("%.1f", x); }

std::string tick_label(double v) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return format("%.0e", v);
  return format("%g", v);
}

std::string text(double x, double y, const std::string& s, const char* anchor, int size = 12,
                 const std::string& extra = "") {
  return "<text x=\"" + num(x) + "\" y=\"" + num(y) + "\" text-anchor=\"" + anchor + "\" font-size=\"" +
         std::to_string(size) + "\"" + extra + ">" + escape(s) + "</text>\n";
}

std::string line(double x1, double y1, double x2, double y2, const std::string& style) {
  return "<line x1=\"" + num(x1) + "\" y1=\"" + num(y1) + "\" x2=\"" + num(x2) + "\" y2=\"" + num(y2) + "\" " +
         style + "/>\n";
}

// Maps data values to pixels along one axis.
struct Axis {
  double lo = 0, hi = 1;  // data range (positive when log)
  bool log = false;
  double p0 = 0, p1 = 1;  // pixel positions of lo and hi
  double to_pixel(double v) const {
    const double a = log ? std::log10(lo) : lo, b = log ? std::log10(hi) : hi;
    const double t = ((log ? std::log10(v) : v) - a) / (b - a);
    return p0 + t * (p1 - p0);
  }
};

// Data range padded so points do not sit on the frame; a degenerate range is widened.
void fit_range(std::vector<double> values, bool log_axis, bool include_zero, double* lo, double* hi) {
  values.erase(std::remove_if(values.begin(), values.end(),
                              [&](double v) { return !std::isfinite(v) || (log_axis && v <= 0); }),
               values.end());
  if (values.empty()) {
    *lo = log_axis ? 1 : 0;
    *hi = log_axis ? 10 : 1;
    return;
  }
  double a = *std::min_element(values.begin(), values.end());
  double b = *std::max_element(values.begin(), values.end());
  if (log_axis) {
    if (a == b) {
      a /= 2;
      b *= 2;
    }
    const double pad = std::pow(b / a, 0.05);
    *lo = a / pad;
    *hi = b * pad;
    return;
  }
  if (include_zero) a = std::min(a, 0.0);
  if (a == b) {
    a -= std::max(1.0, std::fabs(a)) * 0.5;
    b += std::max(1.0, std::fabs(b)) * 0.5;
  }
  const double pad = (b - a) * 0.05;
  *lo = include_zero && a == 0 ? 0 : a - pad;
  *hi = b + pad;
}

std::string header(int width, int height) {
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" +
         std::to_string(width) + "\" height=\"" + std::to_string(height) + "\" viewBox=\"0 0 " +
         std::to_string(width) + " " + std::to_string(height) +
         "\" font-family=\"Helvetica, Arial, sans-serif\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
}

// Frame, grid, ticks and labels of a plot area [left, right] x [top, bottom].
std::string axes(const Axis& x, const Axis& y, const std::string& x_label, const std::string& y_label,
                 bool x_ticks = true) {
  std::string s;
  const double left = x.p0, right = x.p1, bottom = y.p0, top = y.p1;
  for (double t : axis_ticks(y.lo, y.hi, y.log)) {
    const double py = y.to_pixel(t);
    s += line(left, py, right, py, "stroke=\"#e0e0e0\" stroke-width=\"1\"");
    s += line(left - 5, py, left, py, "stroke=\"black\"");
    s += text(left - 8, py + 4, tick_label(t), "end", 11);
  }
  if (x_ticks) {
    for (double t : axis_ticks(x.lo, x.hi, x.log)) {
      const double px = x.to_pixel(t);
      s += line(px, top, px, bottom, "stroke=\"#e0e0e0\" stroke-width=\"1\"");
      s += line(px, bottom, px, bottom + 5, "stroke=\"black\"");
      s += text(px, bottom + 18, tick_label(t), "middle", 11);
    }
  }
  s += "<rect x=\"" + num(left) + "\" y=\"" + num(top) + "\" width=\"" + num(right - left) + "\" height=\"" +
       num(bottom - top) + "\" fill=\"none\" stroke=\"black\"/>\n";
  if (!x_label.empty()) s += text((left + right) / 2, bottom + 38, x_label, "middle", 13);
  const double ly = (top + bottom) / 2, lx = left - 55;
  s += text(lx, ly, y_label, "middle", 13, " transform=\"rotate(-90 " + num(lx) + " " + num(ly) + ")\"");
  return s;
}

}  // namespace

std::vector<double> axis_ticks(double lo, double hi, bool log_axis) {
  std::vector<double> ticks;
  if (!(hi > lo) || !std::isfinite(lo) || !std::isfinite(hi) || (log_axis && lo <= 0)) return ticks;
  if (log_axis) {
    const int e0 = static_cast<int>(std::floor(std::log10(lo))), e1 = static_cast<int>(std::ceil(std::log10(hi)));
    const double decades = std::log10(hi / lo);
    // Short ranges get 2 and 5 (and, shorter still, every integer multiple) between powers of ten.
    std::vector<double> mantissas = {1};
    if (decades < 3) mantissas = {1, 2, 5};
    if (decades < 1) mantissas = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    for (int e = e0; e <= e1 && e - e0 < 400; ++e) {
      for (double m : mantissas) {
        const double t = m * std::pow(10.0, e);
        if (t >= lo * (1 - 1e-9) && t <= hi * (1 + 1e-9)) ticks.push_back(t);
      }
    }
    if (ticks.size() >= 2) return ticks;
    ticks.clear();  // under a factor of ~2: linear ticks read better
  }
  const double raw = (hi - lo) / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  const double step = (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9 && ticks.size() < 50; t += step) {
    ticks.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  }
  return ticks;
}

std::string render_svg(const LinePlot& plot) {
  const int width = 760, height = 480;
  const double left = 90, right = 560, top = 50, bottom = 410;
  std::vector<double> xs, ys;
  for (const Series& s : plot.series) {
    xs.insert(xs.end(), s.x.begin(), s.x.end());
    ys.insert(ys.end(), s.y.begin(), s.y.end());
  }
  Axis x{0, 1, plot.log_x, left, right}, y{0, 1, plot.log_y, bottom, top};
  fit_range(xs, plot.log_x, false, &x.lo, &x.hi);
  fit_range(ys, plot.log_y, !plot.log_y, &y.lo, &y.hi);

  std::string s = header(width, height);
  s += text((left + right) / 2, 28, plot.title, "middle", 15, " font-weight=\"bold\"");
  s += axes(x, y, plot.x_label, plot.y_label);
  for (size_t i = 0; i < plot.series.size(); ++i) {
    const Series& series = plot.series[i];
    const char* color = kPalette[i % kPaletteSize];
    std::string points;
    std::string markers;
    for (size_t j = 0; j < series.x.size() && j < series.y.size(); ++j) {
      const double vx = series.x[j], vy = series.y[j];
      if (!std::isfinite(vx) || !std::isfinite(vy) || (plot.log_x && vx <= 0) || (plot.log_y && vy <= 0)) continue;
      const double px = x.to_pixel(vx), py = y.to_pixel(vy);
      points += num(px) + "," + num(py) + " ";
      markers += "<circle cx=\"" + num(px) + "\" cy=\"" + num(py) + "\" r=\"3.5\" fill=\"" + color + "\"/>\n";
    }
    s += std::string("<polyline fill=\"none\" stroke=\"") + color + "\" stroke-width=\"2\" points=\"" + points +
         "\"/>\n" + markers;
    // Legend to the right of the plot area.
    const double ly = top + 10 + 22 * static_cast<double>(i);
    s += line(right + 20, ly, right + 45, ly, std::string("stroke=\"") + color + "\" stroke-width=\"2\"");
    s += text(right + 52, ly + 4, series.name, "start", 12);
  }
  return s + "</svg>\n";
}

std::string render_svg(const BarChart& chart) {
  const double panel_width = 360, panel_gap = 110, left_margin = 90, top = 50, bottom = 380;
  const size_t panels = std::max<size_t>(1, chart.panels.size());
  const int width = static_cast<int>(left_margin + panels * panel_width + (panels - 1) * panel_gap + 30);
  const int height = 500;
  std::string s = header(width, height);
  s += text(width / 2.0, 28, chart.title, "middle", 15, " font-weight=\"bold\"");
  const size_t n = chart.categories.size();
  for (size_t p = 0; p < chart.panels.size(); ++p) {
    const BarPanel& panel = chart.panels[p];
    const double left = left_margin + p * (panel_width + panel_gap), right = left + panel_width;
    Axis x{0, 1, false, left, right}, y{0, 1, panel.log_y, bottom, top};
    fit_range(panel.values, panel.log_y, !panel.log_y, &y.lo, &y.hi);
    s += axes(x, y, "", panel.y_label, /*x_ticks=*/false);
    const double slot = (right - left) / static_cast<double>(std::max<size_t>(1, n));
    for (size_t i = 0; i < n; ++i) {
      const double cx = left + slot * (static_cast<double>(i) + 0.5);
      const double v = i < panel.values.size() ? panel.values[i] : std::numeric_limits<double>::quiet_NaN();
      const bool drawable = std::isfinite(v) && (!panel.log_y || v > 0);
      if (drawable) {
        const double base = panel.log_y ? bottom : y.to_pixel(0.0);
        const double py = std::clamp(y.to_pixel(v), top, bottom);
        s += "<rect x=\"" + num(cx - slot * 0.35) + "\" y=\"" + num(std::min(py, base)) + "\" width=\"" +
             num(slot * 0.7) + "\" height=\"" + num(std::fabs(base - py)) + "\" fill=\"" + kPalette[i % kPaletteSize] +
             "\"/>\n";
        s += text(cx, std::min(py, base) - 4, format("%.3g", v), "middle", 10);
      } else {
        s += text(cx, bottom - 4, std::isfinite(v) && v == 0 ? "0" : "n/a", "middle", 10);
      }
      // Category labels, rotated so long method names fit.
      const double ly = bottom + 14;
      s += text(cx, ly, chart.categories[i], "end", 11,
                " transform=\"rotate(-35 " + num(cx) + " " + num(ly) + ")\"");
    }
  }
  return s + "</svg>\n";
}

Status write_text_file(const std::string& what, const std::string& path, const std::string& text) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  if (!file) return {StatusCode::io_error, what + ": cannot open '" + path + "' for writing"};
  file << text;
  file.close();
  if (!file) return {StatusCode::io_error, what + ": writing '" + path + "' failed"};
  return {};
}

}  // namespace sparsa::cli
