// The lane code's CPU decoders (lane_native.py): a fine-tune delta added into words in place, and
// DFloat's exponents decoded into words. Formats: lane_code.py, delta_reference.py,
// dfloat_reference.py; these functions compute exactly what the torch references compute.
//
// A group of LANES lanes owns LANES * SYMBOLS consecutive words: at step t lane w decodes word
// t * LANES + w of its group. A group is decoded step by step across its lanes: the LANES
// decodes of a step are independent (each lane has its own bit position), so the CPU overlaps
// their table loads, and they write LANES consecutive words. Groups are independent: `threads`
// threads take contiguous runs of them.
//
// Every read is checked against the sizes passed in: a malformed buffer returns an error code
// (the caller raises) rather than reading out of bounds. Errors are found while decoding, so the
// words may be partly written when one is returned.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t LANES = 32;
constexpr int64_t SYMBOLS = 256;
constexpr int64_t GROUP = LANES * SYMBOLS;
constexpr int BIAS = 127;
constexpr uint32_t ESCAPE = 255;

enum Error : int { OK = 0, STREAM_OVERRUN = 1, ESCAPES_MISMATCH = 2, INDEX_OUT_OF_RANGE = 3 };

struct Code {
    const int16_t* table;
    int bits;  // the longest code: the table has 2**bits entries
    const int32_t* lane_offsets;
    const uint8_t* stream;
    int64_t stream_bytes;  // with the format's 3 bytes of padding
};

// The table entry (symbol | length << 8) of the code at bit `position`. CHECKED: -1 when the
// 3-byte window there passes the stream's end. Unchecked (the caller knows the lane stays
// clear of the end): one 4-byte load.
template <bool CHECKED>
inline int32_t next_entry(const Code& c, int64_t position) {
    const int64_t byte = position >> 3;
    const uint32_t mask = (uint32_t(1) << c.bits) - 1;
    const uint8_t* s = c.stream + byte;
    if (CHECKED) {
        if (byte < 0 || byte + 3 > c.stream_bytes) return -1;
        const uint32_t window = (uint32_t(s[0]) << 16) | (uint32_t(s[1]) << 8) | uint32_t(s[2]);
        return int32_t(uint16_t(c.table[(window >> (24 - c.bits - int(position & 7))) & mask]));
    }
    uint32_t window;
    std::memcpy(&window, s, 4);
    window = __builtin_bswap32(window);  // MSB first
    return int32_t(uint16_t(c.table[(window >> (32 - c.bits - int(position & 7))) & mask]));
}

// Whether every lane of group g stays clear of the stream's end for all SYMBOLS codes (at most
// `bits` bits each) with 4-byte loads: then it needs no check per code.
inline bool clear_of_end(const Code& c, int64_t g) {
    for (int64_t w = 0; w < LANES; ++w) {
        const int64_t start = c.lane_offsets[g * LANES + w];
        if (start < 0 || start + (SYMBOLS * c.bits + 7) / 8 + 4 > c.stream_bytes) return false;
    }
    return true;
}

// Run body(first, end) over the groups [0, groups), on up to `threads` threads; the first error.
template <class Body>
int over_groups(int64_t groups, int threads, Body body) {
    threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, groups)));
    if (threads == 1) return body(0, groups);
    std::atomic<int> error{OK};
    std::vector<std::thread> pool;
    const int64_t per = groups / threads, extra = groups % threads;
    int64_t first = 0;
    for (int k = 0; k < threads; ++k) {
        const int64_t end = first + per + (k < extra ? 1 : 0);
        auto run = [&, first, end] {
            const int rc = body(first, end);
            int expected = OK;
            if (rc != OK) error.compare_exchange_strong(expected, rc);
        };
        if (k + 1 < threads) {
            pool.emplace_back(run);
        } else {
            run();  // the calling thread takes the last share
        }
        first = end;
    }
    for (auto& t : pool) t.join();
    return error.load();
}

// One group of a coded delta: `real` of its words exist (the last group's are fewer).
template <bool FULL, bool CHECKED>
int delta_group(const Code& c, int64_t g, const int32_t* escape_offsets, const int16_t* values,
                int64_t num_escapes, int64_t num_lanes, uint16_t* words, int64_t real, int sign) {
    int64_t position[LANES], next[LANES], end[LANES];
    const int64_t lane0 = g * LANES;
    for (int64_t w = 0; w < LANES; ++w) {
        position[w] = int64_t(c.lane_offsets[lane0 + w]) * 8;
        next[w] = escape_offsets[lane0 + w];
        end[w] = lane0 + w + 1 < num_lanes ? escape_offsets[lane0 + w + 1] : num_escapes;
        if (next[w] < 0 || next[w] > end[w] || end[w] > num_escapes) return ESCAPES_MISMATCH;
    }
    // An escape past a lane's own values reads a clamped one here and fails the check below.
    static const int16_t none = 0;
    const int16_t* value = num_escapes ? values : &none;
    const int64_t last = num_escapes ? num_escapes - 1 : 0;
    uint16_t* out = words + g * GROUP;
    for (int64_t t = 0; t < SYMBOLS; ++t) {
        for (int64_t w = 0; w < LANES; ++w) {
            const int32_t entry = next_entry<CHECKED>(c, position[w]);
            if (CHECKED && entry < 0) return STREAM_OVERRUN;
            position[w] += entry >> 8;
            const int64_t word = t * LANES + w;
            if (!FULL && word >= real) continue;  // padding: decoded, never applied
            const uint32_t symbol = uint32_t(entry) & 0xFF;
            const bool escaped = symbol == ESCAPE;
            const int32_t delta =
                escaped ? int32_t(value[std::min(next[w], last)]) : int32_t(symbol) - BIAS;
            next[w] += escaped;
            out[word] = uint16_t(int32_t(out[word]) + sign * delta);  // mod 2**16
        }
    }
    for (int64_t w = 0; w < LANES; ++w) {
        if (next[w] != end[w]) return ESCAPES_MISMATCH;
    }
    return OK;
}

// One group of DFloat words: sign and mantissa from `sm`, the exponent from the stream.
template <bool FULL, bool CHECKED>
int dfloat_group(const Code& c, int64_t g, const uint8_t* sm, uint16_t* out, int64_t real) {
    int64_t position[LANES];
    for (int64_t w = 0; w < LANES; ++w) position[w] = int64_t(c.lane_offsets[g * LANES + w]) * 8;
    const uint8_t* in = sm + g * GROUP;
    out += g * GROUP;
    for (int64_t t = 0; t < SYMBOLS; ++t) {
        for (int64_t w = 0; w < LANES; ++w) {
            const int32_t entry = next_entry<CHECKED>(c, position[w]);
            if (CHECKED && entry < 0) return STREAM_OVERRUN;
            position[w] += entry >> 8;
            const int64_t word = t * LANES + w;
            if (!FULL && word >= real) continue;
            const uint32_t s = in[word];
            out[word] = uint16_t(((s & 0x80) << 8) | ((uint32_t(entry) & 0xFF) << 7) | (s & 0x7F));
        }
    }
    return OK;
}

}  // namespace

extern "C" {

// words[i] += sign * delta[i] (mod 2**16) for a coded delta of num_words words, in place.
int megaslide_delta_apply(const int16_t* table, int bits, const int32_t* lane_offsets,
                          int64_t num_lanes, const uint8_t* stream, int64_t stream_bytes,
                          const int32_t* escape_offsets, const int16_t* escape_values,
                          int64_t num_escapes, int16_t* words, int64_t num_words, int sign,
                          int threads) {
    const Code c{table, bits, lane_offsets, stream, stream_bytes};
    uint16_t* out = reinterpret_cast<uint16_t*>(words);
    const int64_t groups = num_lanes / LANES;
    return over_groups(groups, threads, [&](int64_t first, int64_t end) {
        for (int64_t g = first; g < end; ++g) {
            const int64_t real = std::min(GROUP, num_words - g * GROUP);
            int rc;
            if (real == GROUP && clear_of_end(c, g)) {
                rc = delta_group<true, false>(c, g, escape_offsets, escape_values, num_escapes,
                                              num_lanes, out, real, sign);
            } else {
                rc = delta_group<false, true>(c, g, escape_offsets, escape_values, num_escapes,
                                              num_lanes, out, real, sign);
            }
            if (rc != OK) return rc;
        }
        return int(OK);
    });
}

// The sparse form: words[index[k]] += sign * value[k] (mod 2**16); no word is written unless
// every index is in range.
int megaslide_delta_apply_sparse(const int32_t* index, const int16_t* values, int64_t count,
                                 int16_t* words, int64_t num_words, int sign) {
    for (int64_t k = 0; k < count; ++k) {
        if (index[k] < 0 || index[k] >= num_words) return INDEX_OUT_OF_RANGE;
    }
    uint16_t* out = reinterpret_cast<uint16_t*>(words);
    for (int64_t k = 0; k < count; ++k) {
        out[index[k]] = uint16_t(int32_t(out[index[k]]) + sign * int32_t(values[k]));
    }
    return OK;
}

// DFloat: out[i] = (sm[i] & 0x80) << 8 | exponent[i] << 7 | (sm[i] & 0x7F).
int megaslide_dfloat_decode(const uint8_t* sm, const int16_t* table, int bits,
                            const int32_t* lane_offsets, int64_t num_lanes, const uint8_t* stream,
                            int64_t stream_bytes, int16_t* out, int64_t num_words, int threads) {
    const Code c{table, bits, lane_offsets, stream, stream_bytes};
    uint16_t* words = reinterpret_cast<uint16_t*>(out);
    return over_groups(num_lanes / LANES, threads, [&](int64_t first, int64_t end) {
        for (int64_t g = first; g < end; ++g) {
            const int64_t real = std::min(GROUP, num_words - g * GROUP);
            const int rc = real == GROUP && clear_of_end(c, g)
                ? dfloat_group<true, false>(c, g, sm, words, real)
                : dfloat_group<false, true>(c, g, sm, words, real);
            if (rc != OK) return rc;
        }
        return int(OK);
    });
}

}  // extern "C"
