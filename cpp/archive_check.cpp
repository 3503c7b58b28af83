#include "archive_check.h"

#include <caffe2/serialize/inline_container.h>

#include <set>
#include <sstream>
#include <stdexcept>

#include "content_digest.h"

namespace blade {
namespace {

std::string read_record(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  return std::string(static_cast<const char*>(data.get()), size);
}

std::string record_digest(caffe2::serialize::PyTorchStreamReader& reader, const std::string& name) {
  auto [data, size] = reader.getRecord(name);
  return Sha256().bytes(data.get(), size).hex();
}

void check_records(caffe2::serialize::PyTorchStreamReader& reader) {
  if (!reader.hasRecord(kRecordsFile)) {
    throw std::runtime_error(std::string("it has no ") + kRecordsFile +
                             " (not a blade archive, or exported by a blade before archive format 3)");
  }
  std::istringstream lines(read_record(reader, kRecordsFile));
  // Not listed: the list itself, and torch's archive id, which torch derives from all records (the
  // list included) and reads back only as an id (blade/export.py's UNLISTED_RECORDS).
  std::set<std::string> listed = {kRecordsFile, ".data/serialization_id"};
  for (std::string line; std::getline(lines, line);) {
    const size_t space = line.find(' ');
    if (space != 64) throw std::runtime_error(std::string(kRecordsFile) + " is not a list of hashes");
    const std::string digest = line.substr(0, space), name = line.substr(space + 1);
    listed.insert(name);
    if (!reader.hasRecord(name)) throw std::runtime_error("record " + name + " is missing");
    if (record_digest(reader, name) != digest) {
      throw std::runtime_error("the SHA-256 of record " + name + " differs from the one saved with it");
    }
  }
  for (const std::string& record : reader.getAllRecords()) {
    if (!listed.count(record)) throw std::runtime_error("record " + record + " is not listed in " + kRecordsFile);
  }
}

}  // namespace

void verify_archive(const std::string& path) {
  try {
    caffe2::serialize::PyTorchStreamReader reader(path);
    check_records(reader);
  } catch (const std::exception& e) {
    const std::string what = e.what();
    throw std::runtime_error("blade archive " + path + " is damaged: " + what.substr(0, what.find('\n')) +
                             "; nothing of it was loaded. Restore a good copy or re-export the model");
  }
}

}  // namespace blade
