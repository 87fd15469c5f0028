package main

import (
	"math/bits"
	"time"
)

// hist is a log-linear latency histogram in nanoseconds (HDR-like): values
// below 64 ns are exact, larger ones fall into one of 32 buckets per power of
// two, so a quantile is within ~3% of the true value. Recording is a few
// integer operations and never allocates; each worker owns one and they are
// merged after the run.
type hist struct {
	counts [histBuckets]uint64
	n      uint64
	max    uint64
}

const (
	subBits     = 6
	halfSub     = 1 << (subBits - 1)
	histBuckets = (64-subBits)*halfSub + 2*halfSub
)

func bucketOf(v uint64) int {
	m := bits.Len64(v)
	if m <= subBits {
		return int(v)
	}
	shift := m - subBits
	return shift*halfSub + int(v>>shift)
}

// bucketRange returns the lowest value of bucket i and its width.
func bucketRange(i int) (low, width uint64) {
	if i < 2*halfSub {
		return uint64(i), 1
	}
	shift := i/halfSub - 1
	mant := uint64(i - shift*halfSub)
	return mant << shift, 1 << shift
}

func (h *hist) record(d time.Duration) {
	v := uint64(0)
	if d > 0 {
		v = uint64(d)
	}
	h.counts[bucketOf(v)]++
	h.n++
	if v > h.max {
		h.max = v
	}
}

func (h *hist) merge(o *hist) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	if o.max > h.max {
		h.max = o.max
	}
}

// quantile returns the q-quantile (0 < q ≤ 1): the middle of the bucket
// holding the rank ⌈q·n⌉, never above the largest value recorded.
func (h *hist) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q * float64(h.n))
	if float64(rank) < q*float64(h.n) {
		rank++
	}
	if rank < 1 {
		rank = 1
	}
	var cum uint64
	for i, c := range h.counts {
		cum += c
		if cum >= rank {
			low, w := bucketRange(i)
			v := low + w/2
			if v > h.max {
				v = h.max
			}
			return time.Duration(v)
		}
	}
	return time.Duration(h.max)
}
