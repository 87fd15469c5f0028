// Package jsonkey selects fields of a JSON payload and encodes their values
// canonically, so that a deduplication key can be hashed from them.
//
// Compile turns a list of dotted paths ("user_id", "report.kind") into a
// Fields. Select then reads a payload once: it validates the whole payload as
// one JSON value and records where each path's value lies (a Span).
// AppendCanonical writes such a value in a canonical, prefix-free byte
// encoding in which two values are equal exactly when encoding/json decodes
// them equally (member order, white space, escapes and the spelling of
// numbers do not matter); AppendString writes any other text (a task type, a
// path) in the same string encoding, and TagNull stands for an absent field
// taken as null.
//
// Guarantees, for any input bytes:
//   - one pass over the payload and no maps. Select allocates nothing, unless
//     it must decode a member name on a selected path that is over 64 bytes
//     and has escapes or non-ASCII bytes; AppendCanonical nothing beyond
//     growing dst, except for objects (whose members it sorts) and escaped
//     strings that decode to over 128 bytes;
//   - Select never panics: whatever is not one valid JSON value (RFC 8259;
//     invalid UTF-8 inside strings is accepted, as by encoding/json) is a
//     *SyntaxError, and so is nesting deeper than MaxDepth, so hostile
//     payloads cannot exhaust the stack;
//   - errors give offsets and what was wrong, never the payload's bytes,
//     which may hold secrets.
package jsonkey
