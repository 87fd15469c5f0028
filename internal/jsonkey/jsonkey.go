package jsonkey

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/bits"
	"slices"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

const (
	// MaxFields is the most paths one Fields holds: each has one bit in a
	// uint64 mask while the payload is scanned.
	MaxFields = 64
	// MaxDepth bounds the nesting of arrays and objects in a payload, so
	// that hostile payloads cannot exhaust the stack: deeper is a
	// *SyntaxError ("nesting too deep").
	MaxDepth = 512
)

// Fields is a compiled, sorted, de-duplicated list of JSON paths, made by
// Compile: the order the paths were listed in does not matter. A nil *Fields,
// like the zero Fields, selects nothing. A Fields is never modified after
// Compile, so one may be used by any number of goroutines at once.
type Fields struct {
	paths []string   // sorted, as given ("report.kind")
	segs  [][]string // paths split on '.'
	// nameLens[d] has bit n set when some path's segment d is n bytes long
	// (bit 63: 63 or more), so that most member names that match no path
	// are passed over without comparing them to each path.
	nameLens []uint64
}

// Compile sorts and de-duplicates paths and splits each on '.' into the
// member names it descends through ("report.kind": member "kind" of the
// top-level member "report"). Names are matched byte for byte against the
// decoded member names of a payload. It returns nil, nil for no paths, and
// an error for more than MaxFields distinct paths or a path with an empty
// segment; the error's text is a bare description ("70 fields selected, at
// most 64") for the caller to prefix.
func Compile(paths []string) (*Fields, error) {
	if len(paths) == 0 {
		return nil, nil
	}
	ps := slices.Clone(paths)
	slices.Sort(ps)
	ps = slices.Compact(ps)
	if len(ps) > MaxFields {
		return nil, fmt.Errorf("%d fields selected, at most %d", len(ps), MaxFields)
	}
	fs := &Fields{paths: ps, segs: make([][]string, len(ps))}
	for i, p := range ps {
		segs := strings.Split(p, ".")
		for _, s := range segs {
			if s == "" {
				return nil, fmt.Errorf("field path %q has an empty segment", p)
			}
		}
		fs.segs[i] = segs
		for len(fs.nameLens) < len(segs) {
			fs.nameLens = append(fs.nameLens, 0)
		}
		for d, s := range segs {
			fs.nameLens[d] |= 1 << min(len(s), 63)
		}
	}
	return fs, nil
}

// Paths returns the compiled paths, sorted: Select's spans[i] is where
// Paths()[i] was found. The slice is shared; callers must not modify it.
func (fs *Fields) Paths() []string {
	if fs == nil {
		return nil
	}
	return fs.paths
}

// Span is where one selected value lies in the payload: payload[Start:End].
type Span struct {
	Start int // offset of the value's first byte
	End   int // offset just past its last byte; 0 when the path was not found
}

// SyntaxError reports malformed JSON (or JSON nested deeper than MaxDepth).
// It gives the offset and what was wrong, never the payload's bytes.
type SyntaxError struct {
	Offset int // where in the payload the problem was found
	msg    string
}

// Error returns "invalid JSON at offset N: " and what was wrong.
func (e *SyntaxError) Error() string {
	return fmt.Sprintf("invalid JSON at offset %d: %s", e.Offset, e.msg)
}

// scanner walks a JSON document once. It records the spans of the selected
// paths and validates everything else by skipping it. Offsets are passed in
// and returned rather than kept in the struct, so that the hot loops keep
// them in registers instead of storing to memory after every byte.
type scanner struct {
	b     []byte
	fs    *Fields
	spans *[MaxFields]Span
}

// Select validates payload as one JSON value and records in spans[i] where
// the value of fs.Paths()[i] lies, or Span{} where the path is absent. A
// repeated member name replaces what an earlier one selected (the last one
// wins, as in encoding/json). A path descends through objects only, never
// into arrays. With no paths (fs nil or empty) Select only validates. It
// returns a *SyntaxError for anything that is not one JSON value, and
// allocates nothing (but see the package doc for one exception).
func Select(payload []byte, fs *Fields, spans *[MaxFields]Span) error {
	s := scanner{b: payload, fs: fs, spans: spans}
	var all uint64
	n := len(fs.Paths())
	if n == 64 {
		all = ^uint64(0)
	} else {
		all = 1<<uint(n) - 1
	}
	clear(spans[:n])
	i, err := s.value(skipWS(payload, 0), 0, all)
	if err != nil {
		return err
	}
	if i = skipWS(payload, i); i != len(payload) {
		return fail(i, "data after the top-level value")
	}
	return nil
}

// fail is the error for malformed JSON at offset i. Kept out of line: the
// scanning functions only pay for it when the input is bad.
//
//go:noinline
func fail(i int, msg string) error { return &SyntaxError{Offset: i, msg: msg} }

// skipWS returns the offset of the first byte at or after i that is not JSON
// white space.
func skipWS(b []byte, i int) int {
	i, _ = nonWS(b, i)
	return i
}

// value scans the value at b[i] (white space skipped) at depth and returns
// the offset just past it; active is the set of paths that pass through this
// value and continue below it. Only objects on a selected path need the
// member-matching walk; everything else is skipped, scalars directly.
func (s *scanner) value(i, depth int, active uint64) (int, error) {
	if depth > MaxDepth {
		return i, fail(i, "nesting too deep")
	}
	if i < len(s.b) {
		switch c := s.b[i]; {
		case c == '"':
			i, _, err := scanString(s.b, i)
			return i, err
		case c == '-' || c-'0' <= 9:
			return scanNumber(s.b, i)
		case c == '{' && active != 0:
			return s.object(i, depth, active)
		}
	}
	return skip(s.b, i, depth)
}

// object scans the object at b[i] whose members may hold selected paths.
func (s *scanner) object(i, depth int, active uint64) (int, error) {
	b := s.b
	if i = skipWS(b, i+1); i < len(b) && b[i] == '}' {
		return i + 1, nil
	}
	for {
		// The member's name and colon.
		key, plain, j, err := memberName(b, skipWS(b, i))
		if err != nil {
			return j, err
		}
		if i = skipWS(b, j); i >= len(b) || b[i] != ':' {
			return i, fail(i, "expected ':'")
		}
		// The paths it continues. A plain name of a length no path has at
		// this depth matches none.
		var ends, deeper uint64
		if !plain || depth >= len(s.fs.nameLens) || s.fs.nameLens[depth]&(1<<min(len(key), 63)) != 0 {
			ends, deeper = s.match(depth, active, key, plain)
		}
		// Its value. A repeated member name replaces what an earlier one
		// selected.
		for m := ends | deeper; m != 0; m &= m - 1 {
			s.spans[bits.TrailingZeros64(m)] = Span{}
		}
		start := skipWS(b, i+1)
		if i, err = s.value(start, depth+1, deeper); err != nil {
			return i, err
		}
		for m := ends; m != 0; m &= m - 1 {
			s.spans[bits.TrailingZeros64(m)] = Span{start, i}
		}
		// Then a comma, or the end of the object.
		if i = skipWS(b, i); i >= len(b) {
			return i, fail(i, "unterminated object")
		}
		switch b[i] {
		case ',':
			i++
		case '}':
			return i + 1, nil
		default:
			return i, fail(i, "expected ',' or '}'")
		}
	}
}

// memberName reads the member name at b[i] and returns its raw contents,
// whether they are plain (no escapes, only ASCII, so their own decoded form),
// and the offset just past it. Plain names, as most are, are read here 8
// bytes at a time; the others by scanString.
func memberName(b []byte, i int) (key []byte, plain bool, end int, err error) {
	if i >= len(b) || b[i] != '"' {
		return nil, false, i, fail(i, "expected member name")
	}
	var seen uint64 // OR of the name's bytes: is any ≥ 0x80?
	for j := i + 1; j+8 <= len(b); j += 8 {
		w := binary.LittleEndian.Uint64(b[j : j+8])
		m := stringStops(w)
		if m == 0 {
			seen |= w
			continue
		}
		n := bits.TrailingZeros64(m) >> 3 // index of the first stop
		seen |= w & (1<<(n<<3) - 1)
		if byte(w>>(n<<3)) == '"' && seen&swarHigh == 0 {
			return b[i+1 : j+n], true, j + n + 1, nil
		}
		break
	}
	if end, plain, err = scanString(b, i); err != nil {
		return nil, false, end, err
	}
	return b[i+1 : end-1], plain, end, nil
}

// match returns which active paths name key at this depth, split into those
// that end here and those that continue into the member's value. plain says
// key has no escapes and is ASCII, so it is already its decoded form.
func (s *scanner) match(depth int, active uint64, key []byte, plain bool) (ends, deeper uint64) {
	if !plain {
		var buf [64]byte
		key = appendUnescaped(buf[:0], key)
	}
	all := s.fs.segs
	for m := active; m != 0; m &= m - 1 {
		p := bits.TrailingZeros64(m)
		segs := all[p]
		// Lengths and first bytes first: most names differ in one or the
		// other, and then cost no call to memequal.
		if seg := segs[depth]; len(seg) != len(key) || seg[0] != key[0] || string(key) != seg {
			continue
		}
		if depth == len(segs)-1 {
			ends |= 1 << uint(p)
		} else {
			deeper |= 1 << uint(p)
		}
	}
	return ends, deeper
}

// skip validates the value at b[i] (white space skipped) at depth and returns
// the offset just past it, with the same errors as a recursive scanner. This
// is where most of a payload is read, so it is one loop over the tokens:
//   - no recursion: the kinds of the open containers are bits in kinds;
//   - strings are passed 8 bytes at a time, inline: they are most of what
//     is read;
//   - compact JSON, with no white space between tokens, takes short cuts.
//
// c is always b[i], or 0 at the end of b.
func skip(b []byte, i, depth int) (_ int, err error) {
	c, base := at(b, i), depth
	var kinds kindStack
	obj, name := false, false // the innermost open container is an object; c starts a member name
	for {
		switch {
		case c == '"':
			for i++; ; {
				if i+8 <= len(b) {
					m := stringStops(binary.LittleEndian.Uint64(b[i : i+8]))
					if m == 0 {
						i += 8
						continue
					}
					i += bits.TrailingZeros64(m) >> 3
				} else if i, err = plainTail(b, i); err != nil {
					return i, err
				}
				if b[i] == '"' {
					break
				}
				if i, err = passEscape(b, i); err != nil {
					return i, err
				}
			}
			if i++; name {
				if i, c, err = memberValue(b, i); err != nil {
					return i, err
				}
				name = false
				continue
			}
		case name:
			return i, fail(i, "expected member name")
		case c == '-' || c-'0' <= 9:
			if i, err = skipNumber(b, i, c); err != nil {
				return i, err
			}
		case c == '{' || c == '[':
			open := c
			if i, c = nonWS(b, i+1); c == open+2 { // '{'+2 == '}', '['+2 == ']'
				i++
				break // empty
			}
			if obj = open == '{'; depth == MaxDepth { // the first element is too deep
				return tooDeep(b, i, c, obj)
			}
			depth, name = kinds.push(depth, obj), obj
			continue
		case c == 't' || c == 'f' || c == 'n':
			n := literalLen(b, i)
			if n == 0 {
				return i, fail(i, "invalid literal")
			}
			i += n
		default:
			return i, badValue(b, i)
		}
		for { // after a value: close the containers it completes, then go on to the next element or member
			if depth == base {
				return i, nil
			}
			if i+1 < len(b) && b[i] == ',' && b[i+1] > ' ' { // compact JSON
				i, c, name = i+1, b[i+1], obj
				break
			}
			if i, c = nonWS(b, i); c == ',' {
				i, c = nonWS(b, i+1)
				name = obj
				break
			}
			if c != '}' && c != ']' || (c == '}') != obj {
				return i, afterValueError(b, i, obj)
			}
			if i, depth = i+1, depth-1; depth > base {
				obj = kinds.isObject(depth - 1)
			}
		}
	}
}

// passEscape passes the escape sequence at b[i], or fails on a bad one or
// an unescaped control character.
func passEscape(b []byte, i int) (int, error) {
	if n := escapeLen(b, i); n != 0 {
		return i + n, nil
	}
	return scanEscape(b, i)
}

// at returns b[i], or 0 at the end of b.
func at(b []byte, i int) byte {
	if i < len(b) {
		return b[i]
	}
	return 0
}

// badValue is the error for b[i], which starts no value.
func badValue(b []byte, i int) error {
	if i >= len(b) {
		return fail(i, "unexpected end of input")
	}
	return fail(i, "unexpected character") // never quote payload bytes
}

// plainTail passes the plain string bytes from b[i] on, near the end of b,
// and fails if the string does not end.
func plainTail(b []byte, i int) (int, error) {
	for i < len(b) && plainStr[b[i]] {
		i++
	}
	if i == len(b) {
		return i, fail(i, "unterminated string")
	}
	return i, nil
}

// memberValue passes the colon after a member name that ends just before
// b[i], and returns the offset and first byte of the member's value.
func memberValue(b []byte, i int) (int, byte, error) {
	if i+1 < len(b) && b[i] == ':' && b[i+1] > ' ' { // compact JSON
		return i + 1, b[i+1], nil
	}
	i, c := nonWS(b, i)
	if c != ':' {
		return i, c, fail(i, "expected ':'")
	}
	i, c = nonWS(b, i+1)
	return i, c, nil
}

// skipNumber passes a number starting with c == b[i]. As scanNumber, but
// only an exponent costs a call.
func skipNumber(b []byte, i int, c byte) (int, error) {
	if c == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i]-'1' < 9:
		for i++; i < len(b) && b[i]-'0' <= 9; i++ {
		}
	default:
		return i, fail(i, "invalid number")
	}
	if i < len(b) && b[i] == '.' {
		j := i + 1
		for j < len(b) && b[j]-'0' <= 9 {
			j++
		}
		if j == i+1 {
			return j, fail(j, "invalid number fraction")
		}
		i = j
	}
	if i < len(b) && b[i]|0x20 == 'e' {
		return numberTail(b, i)
	}
	return i, nil
}

// tooDeep is the error for a container opened at MaxDepth whose first
// element c (at b[i]) would be nested deeper.
func tooDeep(b []byte, i int, c byte, obj bool) (int, error) {
	if obj {
		return deepMember(b, i, c)
	}
	return i, fail(i, "nesting too deep")
}

// afterValueError is the error for b[i], which neither continues nor closes
// the container the last value is in.
func afterValueError(b []byte, i int, obj bool) error {
	switch {
	case i >= len(b) && obj:
		return fail(i, "unterminated object")
	case i >= len(b):
		return fail(i, "unterminated array")
	case obj:
		return fail(i, "expected ',' or '}'")
	}
	return fail(i, "expected ',' or ']'")
}

// deepMember returns the error for an object opened at MaxDepth: that of its
// first member name and colon if they are bad, else that its value is too
// deep (the order in which a recursive scanner would find them).
func deepMember(b []byte, i int, c byte) (int, error) {
	if c != '"' {
		return i, fail(i, "expected member name")
	}
	i, _, err := scanString(b, i)
	if err != nil {
		return i, err
	}
	if i = skipWS(b, i); i >= len(b) || b[i] != ':' {
		return i, fail(i, "expected ':'")
	}
	i = skipWS(b, i+1)
	return i, fail(i, "nesting too deep")
}

// nonWS returns the offset of the first byte at or after i that is not JSON
// white space, and that byte; at the end of b, len(b) and 0. The first test
// is all compact JSON needs.
func nonWS(b []byte, i int) (int, byte) {
	if i < len(b) && b[i] > ' ' {
		return i, b[i]
	}
	return nonWSLoop(b, i)
}

func nonWSLoop(b []byte, i int) (int, byte) {
	const ws = 1<<' ' | 1<<'\t' | 1<<'\n' | 1<<'\r'
	for ; i < len(b); i++ {
		if c := b[i]; c > ' ' || ws>>c&1 == 0 {
			return i, c
		}
	}
	return i, 0
}

// kindStack has bit d set when the container open at depth d is an object,
// clear when it is an array: skip keeps one instead of recursing.
type kindStack [MaxDepth/64 + 1]uint64

// push records the container opened at depth and returns the depth inside
// it.
func (k *kindStack) push(depth int, obj bool) int {
	k.set(depth, obj)
	return depth + 1
}

func (k *kindStack) set(depth int, obj bool) {
	d := uint(depth)
	if obj {
		k[d/64] |= 1 << (d % 64)
	} else {
		k[d/64] &^= 1 << (d % 64)
	}
}

func (k *kindStack) isObject(depth int) bool {
	d := uint(depth)
	return k[d/64]&(1<<(d%64)) != 0
}

// literalLen returns the length of the literal true, false or null at b[i],
// or 0 if there is none. Comparing with constant strings compiles to a few
// wide loads.
func literalLen(b []byte, i int) int {
	switch w := b[i:min(i+5, len(b))]; {
	case len(w) >= 4 && (string(w[:4]) == "true" || string(w[:4]) == "null"):
		return 4
	case string(w) == "false":
		return 5
	}
	return 0
}

// SWAR ("SIMD within a register") constants: a byte value repeated in each
// of the 8 bytes of a word.
const (
	swarOnes = 0x0101010101010101
	swarHigh = 0x8080808080808080
)

// stringStops returns the high bit of every byte of the little-endian word w
// that ends a run of plain string bytes: '"', '\\' or a control character
// (< 0x20). Borrows between bytes can flag bytes above the first stop, never
// below it, so the lowest set bit is exact. Bytes ≥ 0x80 are never flagged.
func stringStops(w uint64) uint64 {
	q := w ^ (swarOnes * '"')  // zero bytes where w has '"'
	e := w ^ (swarOnes * '\\') // zero bytes where w has '\\'
	// A byte's high bit survives x - 1 (x - 0x20) when it is 0 (< 0x20) or
	// ≥ 0x81 (0xa0); &^ w drops the bytes ≥ 0x80, whose high bit is the same
	// in q, e and w.
	return ((q - swarOnes) | (e - swarOnes) | (w - swarOnes*0x20)) &^ w & swarHigh
}

// scanString scans the string at b[i] (its opening quote) and returns the
// offset just past its closing quote. plain reports that it holds no escapes
// and only ASCII, so that its contents are their own decoded form. (skip and
// object have their own copies of this loop, for speed.)
func scanString(b []byte, i int) (end int, plain bool, err error) {
	i++
	var seen uint64 // OR of the plain bytes passed: is any ≥ 0x80?
	esc := false
	for {
		if i+8 <= len(b) {
			w := binary.LittleEndian.Uint64(b[i:])
			m := stringStops(w)
			if m == 0 {
				seen |= w
				i += 8
				continue
			}
			m &= -m // the first stop
			seen |= w & (m - 1)
			i += bits.TrailingZeros64(m) >> 3
		} else {
			for i < len(b) && plainStr[b[i]] {
				seen |= uint64(b[i])
				i++
			}
			if i == len(b) {
				return i, false, fail(i, "unterminated string")
			}
		}
		if b[i] == '"' {
			return i + 1, !esc && seen&swarHigh == 0, nil
		}
		esc = true
		if n := escapeLen(b, i); n != 0 {
			i += n
			continue
		}
		i, err = scanEscape(b, i)
		return i, false, err
	}
}

// escapeLen returns the length of the valid escape sequence at b[i], or 0
// if there is none (scanEscape then says what is wrong).
func escapeLen(b []byte, i int) int {
	if b[i] != '\\' || i+1 >= len(b) {
		return 0
	}
	switch b[i+1] {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		return 2
	case 'u':
		if i+6 <= len(b) && isHex[b[i+2]] && isHex[b[i+3]] && isHex[b[i+4]] && isHex[b[i+5]] {
			return 6
		}
	}
	return 0
}

// isHex marks the hexadecimal digits.
var isHex = func() (t [256]bool) {
	for c := range t {
		t[c] = unhex(byte(c)) >= 0
	}
	return t
}()

// scanEscape returns the error for what stopped a run of plain string bytes
// at b[i] when it is neither the closing quote nor a valid escape sequence.
func scanEscape(b []byte, i int) (int, error) {
	switch {
	case b[i] != '\\':
		return i, fail(i, "control character in string")
	case i+1 >= len(b):
		return i, fail(i, "unterminated escape")
	case b[i+1] != 'u':
		return i, fail(i, "invalid escape")
	case i+6 > len(b):
		return i, fail(i, "short \\u escape")
	}
	return i, fail(i, "invalid \\u escape")
}

// plainStr marks the bytes a string can hold without ending or escaping, for
// the bytes scanString cannot read as a whole word.
var plainStr = func() (t [256]bool) {
	for c := 0x20; c < 256; c++ {
		t[c] = c != '"' && c != '\\'
	}
	return t
}()

// scanNumber scans the number at b[i] and returns the offset just past it.
// (skip reads the integer part inline, the same way.)
func scanNumber(b []byte, i int) (int, error) {
	if b[i] == '-' {
		i++
	}
	switch {
	case i < len(b) && b[i] == '0':
		i++
	case i < len(b) && b[i]-'1' < 9:
		i = skipDigits(b, i+1)
	default:
		return i, fail(i, "invalid number")
	}
	return numberTail(b, i)
}

// numberTail scans the optional fraction and exponent of a number at b[i],
// just past its integer part.
func numberTail(b []byte, i int) (int, error) {
	if i < len(b) && b[i] == '.' {
		j := skipDigits(b, i+1)
		if j == i+1 {
			return j, fail(j, "invalid number fraction")
		}
		i = j
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		j := skipDigits(b, i)
		if j == i {
			return j, fail(j, "invalid number exponent")
		}
		i = j
	}
	return i, nil
}

func skipDigits(b []byte, i int) int {
	for i < len(b) && b[i]-'0' <= 9 {
		i++
	}
	return i
}

func unhex(c byte) int {
	switch {
	case c >= '0' && c <= '9':
		return int(c - '0')
	case c >= 'a' && c <= 'f':
		return int(c-'a') + 10
	case c >= 'A' && c <= 'F':
		return int(c-'A') + 10
	}
	return -1
}

// appendUnescaped decodes the raw contents of a valid JSON string. Like
// encoding/json, invalid UTF-8 and lone surrogates become U+FFFD, so two
// strings encoding/json decodes equally decode equally here.
func appendUnescaped(dst, raw []byte) []byte {
	for i := 0; i < len(raw); {
		c := raw[i]
		if c == '\\' {
			switch raw[i+1] {
			case '"', '\\', '/':
				dst = append(dst, raw[i+1])
			case 'b':
				dst = append(dst, '\b')
			case 'f':
				dst = append(dst, '\f')
			case 'n':
				dst = append(dst, '\n')
			case 'r':
				dst = append(dst, '\r')
			case 't':
				dst = append(dst, '\t')
			case 'u':
				r := hex4(raw[i+2:])
				i += 6
				if utf16.IsSurrogate(r) {
					if i+6 <= len(raw) && raw[i] == '\\' && raw[i+1] == 'u' {
						if r2 := utf16.DecodeRune(r, hex4(raw[i+2:])); r2 != utf8.RuneError {
							dst = utf8.AppendRune(dst, r2)
							i += 6
							continue
						}
					}
					r = utf8.RuneError
				}
				dst = utf8.AppendRune(dst, r)
				continue
			}
			i += 2
			continue
		}
		if c < utf8.RuneSelf {
			dst = append(dst, c)
			i++
			continue
		}
		r, size := utf8.DecodeRune(raw[i:])
		if r == utf8.RuneError && size == 1 {
			dst = utf8.AppendRune(dst, utf8.RuneError)
		} else {
			dst = append(dst, raw[i:i+size]...)
		}
		i += size
	}
	return dst
}

func hex4(b []byte) rune {
	return rune(unhex(b[0])<<12 | unhex(b[1])<<8 | unhex(b[2])<<4 | unhex(b[3]))
}

// TagNull is the canonical encoding of JSON null: one byte. A caller that
// treats an absent field as null writes it in the field's place.
const TagNull = 'z'

// Canonical encoding tags: each value's encoding starts with one. The
// encoding is prefix-free, so a sequence of encoded values can be hashed
// without length prefixes.
const (
	tagTrue   = 't'
	tagFalse  = 'f'
	tagNumber = 'n'
	tagString = 's'
	tagArray  = 'a'
	tagObject = 'o'
	tagEnd    = 0xff // closes arrays and objects; never starts a value
)

// AppendCanonical appends to dst the canonical encoding of the JSON value v,
// so that values encoding/json decodes equally encode equally, and others
// never do:
//   - strings: decoded (escapes resolved, invalid UTF-8 as U+FFFD), with 0x00
//     and 0x01 escaped, then a 0x00 terminator;
//   - numbers: exact decimal — sign, significant digits without leading or
//     trailing zeros, and a base-10 exponent; -0 and 0 are equal;
//   - objects: members sorted by decoded name, duplicate names keep the last;
//   - arrays: elements in order; white space never matters.
//
// v must be valid JSON, such as a span of a payload Select accepted:
// AppendCanonical does not validate it again, and on other input it may fail
// or panic. For valid JSON its only error is for a number whose decimal
// exponent is beyond ±1e9, which it cannot compare exactly; the error does
// not quote the number.
func AppendCanonical(dst, v []byte) ([]byte, error) {
	dst, _, err := canon(dst, v, 0)
	return dst, err
}

// canon appends the encoding of the value at or after v[i] (leading white
// space allowed) and returns the offset just past it.
//
// canon stays one self-recursive function, longer than the others: split
// into mutually recursive functions for arrays and objects, or storing a
// slice of its results, it makes dst escape, and fingerprint's stack buffer
// then moves to the heap (one allocation for every key).
func canon(dst, v []byte, i int) ([]byte, int, error) {
	i = skipWS(v, i)
	var err error
	switch c := v[i]; {
	case c == '"':
		start := i
		var plain bool
		if i, plain, err = scanString(v, i); err != nil {
			return nil, i, err
		}
		return appendCanonString(dst, v[start+1:i-1], plain), i, nil
	case c == '-' || c-'0' <= 9:
		start := i
		if i, err = scanNumber(v, i); err != nil {
			return nil, i, err
		}
		dst, err = appendCanonNumber(dst, v[start:i])
		return dst, i, err
	case c == 't':
		return append(dst, tagTrue), i + len("true"), nil
	case c == 'f':
		return append(dst, tagFalse), i + len("false"), nil
	case c == 'n':
		return append(dst, TagNull), i + len("null"), nil
	case c == '[':
		dst = append(dst, tagArray)
		i++
		for {
			i = skipWS(v, i)
			switch v[i] {
			case ']':
				return append(dst, tagEnd), i + 1, nil
			case ',':
				i++
				continue
			}
			if dst, i, err = canon(dst, v, i); err != nil {
				return nil, i, err
			}
		}
	case c == '{':
		// Members are encoded one after another into scratch, then sorted
		// as offsets by appendMembers.
		var members []member
		var scratch []byte
		i++
		for {
			i = skipWS(v, i)
			switch v[i] {
			case '}':
				return appendMembers(dst, scratch, members), i + 1, nil
			case ',':
				i++
				continue
			}
			start := i
			var plain bool
			if i, plain, err = scanString(v, i); err != nil {
				return nil, i, err
			}
			m := member{key: len(scratch)}
			scratch = appendCanonString(scratch, v[start+1:i-1], plain)
			m.val = len(scratch)
			i = skipWS(v, i) + 1 // ':'
			if scratch, i, err = canon(scratch, v, i); err != nil {
				return nil, i, err
			}
			m.end = len(scratch)
			members = append(members, m)
		}
	}
	return nil, i, fail(i, "unexpected character")
}

// member is one member of an object being encoded: scratch[key:val] is its
// encoded name, scratch[val:end] its encoded value.
type member struct{ key, val, end int }

// appendMembers appends the encoding of an object whose members are encoded
// in scratch: tagObject, the members sorted by name (of equal names, the
// last only), tagEnd.
func appendMembers(dst, scratch []byte, members []member) []byte {
	// Stable sort keeps source order among equal names; keep the last.
	slices.SortStableFunc(members, func(a, b member) int {
		return bytes.Compare(scratch[a.key:a.val], scratch[b.key:b.val])
	})
	dst = append(dst, tagObject)
	for k, m := range members {
		if k+1 < len(members) {
			if n := members[k+1]; bytes.Equal(scratch[n.key:n.val], scratch[m.key:m.val]) {
				continue
			}
		}
		dst = append(dst, scratch[m.key:m.end]...)
	}
	return append(dst, tagEnd)
}

// appendCanonString writes the string with raw contents raw; plain says they
// need no decoding (no escapes, only ASCII).
func appendCanonString(dst, raw []byte, plain bool) []byte {
	if !plain {
		var buf [128]byte
		raw = appendUnescaped(buf[:0], raw)
	}
	return AppendString(dst, raw)
}

// AppendString appends s verbatim in the canonical string encoding: the
// string tag, s with 0x00 and 0x01 escaped (as 0x01 0x01 and 0x01 0x02), then
// a 0x00 terminator, as AppendCanonical writes a decoded JSON string. For
// text that is not JSON (task types, field paths): nothing is unescaped. Runs
// without 0x00 or 0x01 are copied whole.
func AppendString[S string | []byte](dst []byte, s S) []byte {
	dst = append(dst, tagString)
	for {
		i := 0
		for i < len(s) && s[i] > 0x01 {
			i++
		}
		dst = append(dst, s[:i]...)
		if i == len(s) {
			return append(dst, 0x00)
		}
		dst = append(dst, 0x01, s[i]+1)
		s = s[i+1:]
	}
}

// maxExponent bounds the decimal exponent of a selected number: far beyond
// float64's range, small enough that exponent arithmetic cannot overflow.
const maxExponent = 1_000_000_000

// appendCanonNumber writes a valid JSON number as exact decimal: value =
// sign × digits × 10^exp with digits free of leading and trailing zeros.
func appendCanonNumber(dst, n []byte) ([]byte, error) {
	neg := n[0] == '-'
	if neg {
		n = n[1:]
	}
	if isDigits(n) && n[0] != '0' {
		// An integer other than 0, the usual case: its digits without
		// the trailing zeros, which make the exponent.
		t := len(n)
		for n[t-1] == '0' {
			t--
		}
		dst = append(dst, tagNumber)
		if neg {
			dst = append(dst, '-')
		}
		dst = append(dst, n[:t]...)
		dst = append(dst, 'e')
		dst = appendInt(dst, int64(len(n)-t))
		return append(dst, 0x00), nil
	}
	mant, exp, err := splitExponent(n)
	if err != nil {
		return nil, err
	}
	intPart, frac := mant, []byte(nil)
	if i := indexAny(mant, '.', '.'); i >= 0 {
		intPart, frac = mant[:i], mant[i+1:]
	}
	return appendDecimal(dst, neg, intPart, frac, exp-int64(len(frac))), nil
}

// splitExponent splits the unsigned number n into the digits before its
// exponent (with any fraction) and the exponent's value, 0 if it has none.
func splitExponent(n []byte) (mant []byte, exp int64, err error) {
	i := indexAny(n, 'e', 'E')
	if i < 0 {
		return n, 0, nil
	}
	e := n[i+1:]
	neg := false
	if e[0] == '+' || e[0] == '-' {
		neg = e[0] == '-'
		e = e[1:]
	}
	for _, c := range e {
		exp = exp*10 + int64(c-'0')
		if exp > maxExponent {
			return nil, 0, fmt.Errorf("number exponent out of range (|exp| > %d)", maxExponent)
		}
	}
	if neg {
		exp = -exp
	}
	return n[:i], exp, nil
}

// appendDecimal writes the number ±d × 10^exp, where d is the decimal
// digits of intPart followed by those of frac: its significant digits,
// without leading or trailing zeros, and the exponent that goes with them.
func appendDecimal(dst []byte, neg bool, intPart, frac []byte, exp int64) []byte {
	total := len(intPart) + len(frac)
	at := func(i int) byte {
		if i < len(intPart) {
			return intPart[i]
		}
		return frac[i-len(intPart)]
	}
	lead, trail := 0, total-1
	for lead < total && at(lead) == '0' {
		lead++
	}
	if lead == total {
		return append(dst, tagNumber, '0', 0x00)
	}
	for at(trail) == '0' {
		trail--
	}
	exp += int64(total - 1 - trail)
	dst = append(dst, tagNumber)
	if neg {
		dst = append(dst, '-')
	}
	for i := lead; i <= trail; i++ {
		dst = append(dst, at(i))
	}
	dst = append(dst, 'e')
	dst = appendInt(dst, exp)
	return append(dst, 0x00)
}

// isDigits reports whether b holds only decimal digits.
func isDigits(b []byte) bool {
	for _, c := range b {
		if c-'0' > 9 {
			return false
		}
	}
	return true
}

func indexAny(b []byte, x, y byte) int {
	for i, c := range b {
		if c == x || c == y {
			return i
		}
	}
	return -1
}

func appendInt(dst []byte, v int64) []byte {
	if v < 0 {
		dst = append(dst, '-')
		v = -v
	}
	var buf [20]byte
	i := len(buf)
	for {
		i--
		buf[i] = byte('0' + v%10)
		v /= 10
		if v == 0 {
			break
		}
	}
	return append(dst, buf[i:]...)
}
