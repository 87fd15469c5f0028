package dedupweb

import "strconv"

// chart is a small bar chart drawn by the server as SVG: one bar per
// minute, scaled to the largest.
type chart struct {
	W, H int
	Bars []bar
	Max  uint64
}

// bar is one rectangle of a chart, its numbers formatted for SVG.
type bar struct {
	X, Y, W, H string
	N          uint64
}

const (
	barStep    = 2.0  // viewBox units per minute
	chartH     = 24.0 // viewBox height
	barFilling = 0.8  // part of the step a bar fills
)

// barChart draws vals, one bar each; a zero draws no bar.
func barChart(vals []uint64) chart {
	c := chart{W: int(barStep * float64(len(vals))), H: int(chartH)}
	for _, v := range vals {
		c.Max = max(c.Max, v)
	}
	for i, v := range vals {
		if v == 0 {
			continue
		}
		h := max(1, chartH*float64(v)/float64(c.Max))
		c.Bars = append(c.Bars, bar{X: num(barStep * float64(i)), Y: num(chartH - h), W: num(barStep * barFilling), H: num(h), N: v})
	}
	return c
}

func num(f float64) string { return strconv.FormatFloat(f, 'f', 2, 64) }
