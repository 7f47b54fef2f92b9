// safetensors header validation: every malformed input is a specific tansy::error.
#include <cstring>
#include <string>

#include "core/check.h"
#include "loader/safetensors.h"
#include "synth_model.h"
#include "test_util.h"

using namespace tansy;

namespace {

std::string image(const std::string& header, size_t data_bytes, uint64_t claimed_len = UINT64_MAX) {
    uint64_t n = claimed_len == UINT64_MAX ? header.size() : claimed_len;
    std::string s(8, '\0');
    for (int i = 0; i < 8; i++) s[i] = (char)(n >> (8 * i));
    return s + header + std::string(data_bytes, '\x01');
}

// Expects parse to fail with a message containing `needle`.
void expect_error(const std::string& img, const std::string& needle) {
    try {
        parse_safetensors_image((const uint8_t*)img.data(), img.size(), "t.safetensors");
        ADD_FAILURE() << "no error; wanted '" << needle << "'";
    } catch (const tansy::error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "message: " << e.what();
    }
}

}  // namespace

TEST(safetensors, parses_valid_header_and_metadata) {
    std::string h = R"({"__metadata__":{"format":"pt"},"b":{"dtype":"BF16","shape":[2,3],"data_offsets":[16,28]},)"
                    R"("a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"e":{"dtype":"U32","shape":[0],"data_offsets":[28,28]}})";
    std::string img = image(h, 28);
    st_header hdr = parse_safetensors_image((const uint8_t*)img.data(), img.size(), "t");
    ASSERT_EQ(hdr.tensors.size(), 3u);
    EXPECT_EQ(hdr.tensors[0].name, "a");  // sorted by offset
    EXPECT_EQ(hdr.tensors[1].name, "b");
    EXPECT_EQ(hdr.tensors[1].type, dtype::bf16);
    EXPECT_EQ(hdr.tensors[1].shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(hdr.tensors[1].data, (const uint8_t*)img.data() + 8 + h.size() + 16);
    ASSERT_EQ(hdr.metadata.size(), 1u);
    EXPECT_EQ(hdr.metadata[0].second, "pt");
}

TEST(safetensors, rejects_malformed_files) {
    const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
    expect_error("abc", "too small");
    expect_error(image(ok, 8, 1000), "exceeds the file size");
    expect_error(image(ok, 4), "past the data section");  // truncated data
    expect_error(image("{not json", 0), "not valid JSON");
    expect_error(image("[1,2]", 0), "must be a JSON object");
    expect_error(image(R"({"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype");
    expect_error(image(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8), "missing dtype");
    expect_error(image(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8), "non-negative");
    expect_error(image(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8), "non-negative");
    expect_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin > end");
    expect_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "data_offsets");
    expect_error(image(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12), "needs 12 bytes");
    expect_error(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
                 "overlap");
    expect_error(image(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})", 8),
                 "overflows");
    expect_error(image(R"({"__metadata__":{"k":1}})", 0), "not a string");
    expect_error(image(R"({"a":7})", 0), "not an object");
    expect_error(image("{\"a\xff\":{}}", 0), "not valid JSON");  // invalid UTF-8 in a name
}

TEST(safetensors, write_then_read_round_trip) {
    std::string dir = test::temp_dir("st");
    std::vector<float> a = {1, 2, 3, 4, 5, 6};
    std::vector<uint16_t> b = {f32_to_bf16(1.5f), f32_to_bf16(-2.0f), f32_to_bf16(0.25f)};
    write_safetensors(dir + "/x.safetensors", {{"alpha", dtype::f32, {2, 3}, a.data()}, {"beta", dtype::bf16, {3}, b.data()}},
                      {{"format", "pt"}});
    st_file f(dir + "/x.safetensors");
    const st_tensor* ta = f.find("alpha");
    const st_tensor* tb = f.find("beta");
    ASSERT_TRUE(ta && tb);
    EXPECT_EQ(memcmp(ta->data, a.data(), 24), 0);
    EXPECT_EQ(memcmp(tb->data, b.data(), 6), 0);
    EXPECT_EQ(f.find("gamma"), nullptr);
}

TEST(safetensors, missing_and_special_files) {
    EXPECT_THROW(st_file("/nonexistent/x.safetensors"), tansy::error);
    EXPECT_THROW(st_file("/tmp"), tansy::error);  // a directory
    std::string dir = test::temp_dir("st");
    test::write_file(dir + "/empty.safetensors", "");
    EXPECT_THROW(st_file(dir + "/empty.safetensors"), tansy::error);
}
