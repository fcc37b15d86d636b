// An aligned text table for stdout: first column left-aligned (names), the rest
// right-aligned (numbers), two spaces between columns, a rule under the header.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace sparsa::cli {

class Table {
 public:
  explicit Table(std::vector<std::string> headers) : headers_(std::move(headers)) {}
  void add_row(std::vector<std::string> cells) { rows_.push_back(std::move(cells)); }
  std::string render() const;

 private:
  std::vector<std::string> headers_;
  std::vector<std::vector<std::string>> rows_;
};

}  // namespace sparsa::cli
