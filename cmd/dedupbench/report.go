package main

import (
	"encoding/json"
	"fmt"
	"io"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"
)

type meta struct {
	Date            string `json:"date"`
	Go              string `json:"go"`
	Asynq           string `json:"asynq"`
	GoRedis         string `json:"go_redis"`
	Redis           string `json:"redis"`
	CPUs            int    `json:"cpus"`
	GOMAXPROCS      int    `json:"gomaxprocs"`
	Where           string `json:"where"`
	Pool            int    `json:"pool_size"`
	ContextTimeouts bool   `json:"context_timeout_enabled"`
	MaxBatch        int    `json:"max_batch"` // dedup Config.MaxBatch as given (0: default)
	Duration        string `json:"duration"`
	Rounds          int    `json:"rounds"`
	Concurrency     []int  `json:"concurrency"`
	Payload         int    `json:"payload_bytes"`
	Keys            int    `json:"keys"`
	KeysLeft        int    `json:"keys_left"`
}

// caseSummary is one case at one concurrency over all rounds.
type caseSummary struct {
	Case            string             `json:"case"`
	Title           string             `json:"title"`
	C               int                `json:"c"`
	OpsPerSec       float64            `json:"ops_per_sec"` // median over rounds
	OpsPerSecRounds []float64          `json:"ops_per_sec_rounds"`
	P50             int64              `json:"p50_ns"` // over all rounds' calls
	P99             int64              `json:"p99_ns"`
	Ratio           *float64           `json:"ratio,omitempty"` // median of per-round ratios to plain Enqueue
	RatioMin        *float64           `json:"ratio_min,omitempty"`
	RatioMax        *float64           `json:"ratio_max,omitempty"`
	RatioRounds     []float64          `json:"ratio_rounds,omitempty"`
	RCPURatio       *float64           `json:"redis_cpu_ratio,omitempty"` // median of per-round Redis CPU per call ÷ plain Enqueue's (rounds without a reading left out)
	RCPURatioMin    *float64           `json:"redis_cpu_ratio_min,omitempty"`
	RCPURatioMax    *float64           `json:"redis_cpu_ratio_max,omitempty"`
	RCPURatioRounds []float64          `json:"redis_cpu_ratio_rounds,omitempty"`
	CmdsPerOp       float64            `json:"cmds_per_op"`
	RttsPerOp       float64            `json:"round_trips_per_op"`
	CmdsByName      map[string]float64 `json:"cmds_per_op_by_name"`
	ClientUsPerOp   float64            `json:"client_cpu_us_per_op"` // this process's CPU time per call
	RedisUsPerOp    float64            `json:"redis_cpu_us_per_op"`  // Redis main thread's CPU time per call
	// CPURatio is plain Enqueue's CPU time per call (client + Redis) over
	// this case's: the ratio to expect when the CPUs are the bottleneck.
	CPURatio     *float64 `json:"cpu_ratio,omitempty"`
	Ops          int64    `json:"ops"`
	Errors       int64    `json:"errors"`
	ErrorSamples []string `json:"error_samples,omitempty"`
}

// e2eSummary is one end-to-end variant in one mode over all rounds.
type e2eSummary struct {
	Mode          string    `json:"mode"`
	Variant       string    `json:"variant"`
	Title         string    `json:"title"`
	EnqueueSec    float64   `json:"enqueue_s"` // medians over rounds
	DrainSec      float64   `json:"drain_s"`
	TotalSec      float64   `json:"total_s"`
	KeySec        float64   `json:"time_s"` // drain (before) or total (live)
	KeySecRounds  []float64 `json:"time_s_rounds"`
	Speedup       *float64  `json:"speedup,omitempty"` // median of per-round plain/variant
	SpeedupRounds []float64 `json:"speedup_rounds,omitempty"`
	Processed     int64     `json:"processed"` // median
	Created       int64     `json:"created"`
	Folded        int64     `json:"folded"`
	Rejected      int64     `json:"rejected"`
	Cmds          int64     `json:"redis_cmds"` // median
	Errors        int64     `json:"errors"`
	ErrorSamples  []string  `json:"error_samples,omitempty"`
}

type report struct {
	Meta        meta           `json:"meta"`
	Throughput  []caseSummary  `json:"throughput"`
	E2E         []e2eSummary   `json:"end_to_end,omitempty"`
	E2EConfig   *e2eConfig     `json:"end_to_end_config,omitempty"`
	Drain       []drainSummary `json:"drain,omitempty"`
	DrainConfig *drainConfig   `json:"drain_config,omitempty"`
	Batch       []batchSummary `json:"batch,omitempty"`
	BatchConfig *batchConfig   `json:"batch_config,omitempty"`
	Errors      int64          `json:"unexpected_errors"`
}

type e2eConfig struct {
	Tasks     int    `json:"tasks"`
	Keys      int    `json:"keys"`
	Work      string `json:"handler_work"`
	Workers   int    `json:"workers"`
	Producers int    `json:"producers"`
	CheckIvl  string `json:"task_check_interval"`
}

type drainConfig struct {
	Tasks    int    `json:"tasks"`
	Workers  int    `json:"workers"`
	Work     string `json:"handler_work"`
	CheckIvl string `json:"task_check_interval"`
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if n := len(s); n%2 == 1 {
		return s[n/2]
	} else {
		return (s[n/2-1] + s[n/2]) / 2
	}
}

func ptr(f float64) *float64 { return &f }

func (rep *report) summarize(cfg config, selected []*caseDef, all *allRuns) {
	rep.summarizeDrains(cfg, all.drain)
	rep.summarizeBatches(cfg, all.batch)
	runs, e2eRuns := all.throughput, all.e2e
	for _, c := range cfg.conc {
		plain := runs[c]["plain"]
		for _, cd := range selected {
			s := summarizeCase(cd, c, runs[c][cd.name], plain)
			rep.Errors += s.Errors
			rep.Throughput = append(rep.Throughput, s)
		}
		rep.setCPURatios(c)
	}
	if len(e2eRuns) == 0 {
		return
	}
	rep.E2EConfig = &e2eConfig{Tasks: cfg.e2eTasks, Keys: cfg.e2eKeys, Work: cfg.e2eWork.String(),
		Workers: cfg.e2eWorkers, Producers: cfg.e2eProducers, CheckIvl: cfg.e2eCheck.String()}
	for _, m := range cfg.e2eModes {
		plain := e2eRuns[m]["plain"]
		for _, v := range e2eVariants {
			s := summarizeE2E(m, v, e2eRuns[m][v.name], plain)
			rep.Errors += s.Errors
			rep.E2E = append(rep.E2E, s)
		}
	}
}

// summarizeCase sums up case cd's rounds rs at concurrency c; plain holds
// plain Enqueue's rounds at c, for the ratios round by round.
func summarizeCase(cd *caseDef, c int, rs, plain []*runResult) caseSummary {
	s := caseSummary{Case: cd.name, Title: cd.title, C: c, CmdsByName: map[string]float64{}}
	h := new(hist)
	var cmds counts
	var cpu, rcpu time.Duration
	for i, r := range rs {
		cpu += r.cpu
		rcpu += r.rcpu
		s.OpsPerSecRounds = append(s.OpsPerSecRounds, r.opsPerSec())
		s.Ops += r.ops
		s.Errors += r.errs
		s.ErrorSamples = append(s.ErrorSamples, r.samples...)
		h.merge(r.h)
		cmds.add(r.cmds)
		if i < len(plain) && plain[i].opsPerSec() > 0 {
			s.RatioRounds = append(s.RatioRounds, r.opsPerSec()/plain[i].opsPerSec())
		}
		if i < len(plain) {
			x, ok := r.redisPerOp()
			b, okb := plain[i].redisPerOp()
			if ok && okb && b > 0 {
				s.RCPURatioRounds = append(s.RCPURatioRounds, x/b)
			}
		}
	}
	s.OpsPerSec = median(s.OpsPerSecRounds)
	s.P50, s.P99 = int64(h.quantile(0.5)), int64(h.quantile(0.99))
	if len(s.RatioRounds) > 0 {
		s.Ratio = ptr(median(s.RatioRounds))
		s.RatioMin, s.RatioMax = ptr(slices.Min(s.RatioRounds)), ptr(slices.Max(s.RatioRounds))
	}
	if len(s.RCPURatioRounds) > 0 {
		s.RCPURatio = ptr(median(s.RCPURatioRounds))
		s.RCPURatioMin, s.RCPURatioMax = ptr(slices.Min(s.RCPURatioRounds)), ptr(slices.Max(s.RCPURatioRounds))
	}
	if s.Ops > 0 {
		s.CmdsPerOp = float64(cmds.cmds) / float64(s.Ops)
		s.RttsPerOp = float64(cmds.rtts) / float64(s.Ops)
		s.ClientUsPerOp = cpu.Seconds() * 1e6 / float64(s.Ops)
		s.RedisUsPerOp = rcpu.Seconds() * 1e6 / float64(s.Ops)
		for k, v := range cmds.byName {
			s.CmdsByName[k] = float64(v) / float64(s.Ops)
		}
	}
	if len(s.ErrorSamples) > maxSamples {
		s.ErrorSamples = s.ErrorSamples[:maxSamples]
	}
	return s
}

// setCPURatios sets CPURatio of the cases at concurrency c, once plain
// Enqueue's CPU time per call is known.
func (rep *report) setCPURatios(c int) {
	var base *caseSummary
	for i := range rep.Throughput {
		if t := &rep.Throughput[i]; t.C == c && t.Case == "plain" {
			base = t
		}
	}
	for i := range rep.Throughput {
		t := &rep.Throughput[i]
		if base != nil && t.C == c && t.ClientUsPerOp+t.RedisUsPerOp > 0 {
			t.CPURatio = ptr((base.ClientUsPerOp + base.RedisUsPerOp) / (t.ClientUsPerOp + t.RedisUsPerOp))
		}
	}
}

// summarizeE2E sums up variant v's rounds rs in mode m; plain holds plain
// asynq's rounds, for the speedup round by round.
func summarizeE2E(m string, v e2eVariant, rs, plain []*e2eResult) e2eSummary {
	s := e2eSummary{Mode: m, Variant: v.name, Title: v.title}
	var enq, drain, total, proc, created, folded, rejected, cmds []float64
	for i, r := range rs {
		enq = append(enq, r.enqueue.Seconds())
		drain = append(drain, r.drain.Seconds())
		total = append(total, r.total.Seconds())
		s.KeySecRounds = append(s.KeySecRounds, r.key(m).Seconds())
		proc = append(proc, float64(r.processed))
		created = append(created, float64(r.created))
		folded = append(folded, float64(r.folded))
		rejected = append(rejected, float64(r.rejected))
		cmds = append(cmds, float64(r.cmds))
		s.Errors += r.errs
		s.ErrorSamples = append(s.ErrorSamples, r.samples...)
		if i < len(plain) && r.key(m) > 0 {
			s.SpeedupRounds = append(s.SpeedupRounds, plain[i].key(m).Seconds()/r.key(m).Seconds())
		}
	}
	s.EnqueueSec, s.DrainSec, s.TotalSec, s.KeySec = median(enq), median(drain), median(total), median(s.KeySecRounds)
	s.Processed, s.Created, s.Folded, s.Rejected = int64(median(proc)), int64(median(created)), int64(median(folded)), int64(median(rejected))
	s.Cmds = int64(median(cmds))
	if len(s.SpeedupRounds) > 0 {
		s.Speedup = ptr(median(s.SpeedupRounds))
	}
	if len(s.ErrorSamples) > maxSamples {
		s.ErrorSamples = s.ErrorSamples[:maxSamples]
	}
	return s
}

func (rep *report) writeJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

func (rep *report) writeTable(w io.Writer, cfg config) {
	rep.writeHeader(w, cfg)
	errs := rep.writeThroughput(w, cfg)
	if cfg.verbose {
		rep.writeCmdsByName(w)
	}
	if len(rep.E2E) > 0 {
		errs = append(errs, rep.writeE2E(w, cfg)...)
		fmt.Fprintln(w)
		rep.writeE2ESpeedups(w, cfg)
	}
	if len(rep.Drain) > 0 {
		errs = append(errs, rep.writeDrain(w, cfg)...)
	}
	if len(rep.Batch) > 0 {
		errs = append(errs, rep.writeBatch(w, cfg)...)
	}
	if len(errs) > 0 {
		fmt.Fprintf(w, "\nUNEXPECTED OUTCOMES (%d in all; samples):\n", rep.Errors)
		for _, e := range errs {
			fmt.Fprintf(w, "  %s\n", e)
		}
	}
	if rep.Meta.KeysLeft > 0 {
		fmt.Fprintf(w, "\nwarning: %d keys of this run were left in Redis\n", rep.Meta.KeysLeft)
	}
}

// writeHeader writes what was run where, and what the columns mean.
func (rep *report) writeHeader(w io.Writer, cfg config) {
	m := rep.Meta
	fmt.Fprintf(w, "dedupbench  %s  %s  asynq %s  go-redis %s  redis %s  %d CPUs\n", m.Date, m.Go, m.Asynq, m.GoRedis, m.Redis, m.CPUs)
	fmt.Fprintf(w, "%s; one shared go-redis client, PoolSize %d, ContextTimeoutEnabled %v; dedup MaxBatch %s\n", m.Where, m.Pool, m.ContextTimeouts, batchDesc(m.MaxBatch))
	if len(rep.Throughput) > 0 {
		fmt.Fprintf(w, "%d B JSON payloads, %d keys pre-enqueued for dup/rejected/replaced; %v per case × %d rounds, interleaved;\n", m.Payload, m.Keys, cfg.duration, m.Rounds)
		fmt.Fprintf(w, "ops/s and ratio: medians over rounds (ratio = ops/s ÷ plain Enqueue's in the same round; range min–max); p50/p99 over all calls;\n")
		fmt.Fprintf(w, "cmds/op, rtt/op: commands and round trips per call through the shared client; cli µs, rds µs: CPU time per call of this process and of Redis's main thread\n")
		fmt.Fprintf(w, "rds ratio: Redis main-thread CPU per call ÷ plain Enqueue's in the same round (median, range min–max; rounds without a CPU reading skipped)\n")
	}
}

// writeThroughput writes one table per concurrency and returns the error
// samples, for the list at the end.
func (rep *report) writeThroughput(w io.Writer, cfg config) (errs []string) {
	for _, c := range cfg.conc {
		if len(rep.Throughput) == 0 {
			break
		}
		fmt.Fprintf(w, "\n%-18s %8s %7s %7s %5s %-12s %9s %-12s %7s %6s %7s %7s %6s\n", fmt.Sprintf("c=%d", c), "ops/s", "p50", "p99",
			"ratio", " (range)", "rds ratio", " (range)", "cmds/op", "rtt/op", "cli µs", "rds µs", "errors")
		for _, s := range rep.Throughput {
			if s.C != c {
				continue
			}
			ratio, rng := fmtRatio(s.Ratio, s.RatioMin, s.RatioMax, len(s.RatioRounds))
			rratio, rrng := fmtRatio(s.RCPURatio, s.RCPURatioMin, s.RCPURatioMax, len(s.RCPURatioRounds))
			fmt.Fprintf(w, "%-18s %8s %7s %7s %5s %-12s %9s %-12s %7.2f %6.2f %7.1f %7.1f %6d\n", s.Title, commas(int64(s.OpsPerSec)),
				fmtLat(time.Duration(s.P50)), fmtLat(time.Duration(s.P99)), ratio, rng, rratio, rrng,
				s.CmdsPerOp, s.RttsPerOp, s.ClientUsPerOp, s.RedisUsPerOp, s.Errors)
			for _, e := range s.ErrorSamples {
				errs = append(errs, fmt.Sprintf("c=%d %s: %s", c, s.Title, e))
			}
		}
	}
	return errs
}

// writeCmdsByName writes (-v) each case's commands per call by name, most
// first, and its ops/s round by round.
func (rep *report) writeCmdsByName(w io.Writer) {
	fmt.Fprintf(w, "\ncommands per call, by name:\n")
	for _, s := range rep.Throughput {
		names := make([]string, 0, len(s.CmdsByName))
		for k := range s.CmdsByName {
			names = append(names, k)
		}
		slices.SortFunc(names, func(a, b string) int {
			if s.CmdsByName[a] != s.CmdsByName[b] {
				if s.CmdsByName[a] > s.CmdsByName[b] {
					return -1
				}
				return 1
			}
			return strings.Compare(a, b)
		})
		parts := make([]string, 0, len(names))
		for _, n := range names {
			parts = append(parts, fmt.Sprintf("%s %.4g", n, s.CmdsByName[n]))
		}
		rounds := make([]string, 0, len(s.OpsPerSecRounds))
		for _, x := range s.OpsPerSecRounds {
			rounds = append(rounds, commas(int64(x)))
		}
		fmt.Fprintf(w, "  c=%-3d %-20s %s   (ops/s by round: %s)\n", s.C, s.Title, strings.Join(parts, ", "), strings.Join(rounds, " "))
	}
}

// writeE2E writes one end-to-end table per mode and returns the error
// samples, for the list at the end.
func (rep *report) writeE2E(w io.Writer, cfg config) (errs []string) {
	ec := rep.E2EConfig
	fmt.Fprintf(w, "\nend to end: %s enqueues over %s user_ids by %d producers; asynq server Concurrency %d, handler sleeps %v,\n"+
		"TaskCheckInterval %v; dedup Replace = Rule{OnConflict: Replace, OnRunning: RunningDefer}, dedup Reject = defaults; medians of %d rounds\n",
		commas(int64(ec.Tasks)), commas(int64(ec.Keys)), ec.Producers, ec.Workers, cfg.e2eWork, cfg.e2eCheck, rep.Meta.Rounds)
	for _, mode := range cfg.e2eModes {
		fmt.Fprintf(w, "\n%s\n", modeTitles[mode])
		fmt.Fprintf(w, "  %-16s %8s %8s %8s %10s %8s %8s %8s %10s %8s\n", "", "enqueue", "drain", "total", "processed", "created", "folded", "rejected", "redis cmds", "speedup")
		for _, s := range rep.E2E {
			if s.Mode != mode {
				continue
			}
			sp := "-"
			if s.Speedup != nil {
				sp = fmt.Sprintf("%.2f×", *s.Speedup)
			}
			fmt.Fprintf(w, "  %-16s %8s %8s %8s %10s %8s %8s %8s %10s %8s\n", s.Title, fmtSec(secs(s.EnqueueSec)), fmtSec(secs(s.DrainSec)),
				fmtSec(secs(s.TotalSec)), commas(s.Processed), commas(s.Created), commas(s.Folded), commas(s.Rejected), commas(s.Cmds), sp)
			for _, e := range s.ErrorSamples {
				errs = append(errs, fmt.Sprintf("end to end %s %s: %s", mode, s.Title, e))
			}
		}
	}
	return errs
}

// writeE2ESpeedups writes, per mode, the one line that sums it up: plain
// asynq against dedup Replace.
func (rep *report) writeE2ESpeedups(w io.Writer, cfg config) {
	ec := rep.E2EConfig
	for _, mode := range cfg.e2eModes {
		var plain, repl *e2eSummary
		for i := range rep.E2E {
			s := &rep.E2E[i]
			if s.Mode == mode && s.Variant == "plain" {
				plain = s
			}
			if s.Mode == mode && s.Variant == "replace" {
				repl = s
			}
		}
		if plain == nil || repl == nil || repl.Speedup == nil {
			continue
		}
		what := "drain after enqueueing first"
		if mode == modeLive {
			what = "server running, first enqueue to drained"
		}
		fmt.Fprintf(w, "end to end (%s over %s keys, %v handler, %s): plain %.2f s, dedup Replace %.2f s → %.1f× faster\n",
			commas(int64(ec.Tasks)), commas(int64(ec.Keys)), cfg.e2eWork, what, plain.KeySec, repl.KeySec, *repl.Speedup)
	}
}

// fmtRatio formats a median ratio ("-" if none) and, over more than one
// round, its range.
func fmtRatio(med, lo, hi *float64, rounds int) (ratio, rng string) {
	if med == nil {
		return "-", ""
	}
	if rounds > 1 {
		rng = fmt.Sprintf(" (%.2f–%.2f)", *lo, *hi)
	}
	return fmt.Sprintf("%.2f", *med), rng
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func fmtSec(d time.Duration) string { return fmt.Sprintf("%.3fs", d.Seconds()) }

func fmtLat(d time.Duration) string {
	switch {
	case d < time.Millisecond:
		return fmt.Sprintf("%dµs", d.Microseconds())
	case d < 10*time.Millisecond:
		return fmt.Sprintf("%.2fms", float64(d)/1e6)
	default:
		return fmt.Sprintf("%.1fms", float64(d)/1e6)
	}
}

func commas(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, ch := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(ch)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// depVersion is the version of module path linked into this binary.
func depVersion(path string) string {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return "(unknown)"
	}
	for _, d := range bi.Deps {
		if d.Path == path {
			if d.Replace != nil && d.Replace.Version != "" {
				return d.Replace.Version
			}
			return d.Version
		}
	}
	return "(unknown)"
}

func batchDesc(n int) string {
	switch {
	case n == 0:
		return "64 (default)"
	case n < 0:
		return "off"
	}
	return fmt.Sprint(n)
}
