// Package dedupprom exports the event counters of a *dedup.Dedup to
// Prometheus, with github.com/prometheus/client_golang (as asynq's own
// metrics do). It lives in its own package so that programs that use only
// package dedup do not link client_golang.
//
//	import dedupprom "github.com/asynq-dedup/dedup/dedupprom"
//
//	prometheus.MustRegister(dedupprom.NewCollector(d))
//
// gives one counter per task type and event, for this process:
//
//	dedup_events_total{type="email:send",event="locked"} 1520
//	dedup_events_total{type="email:send",event="replaced"} 311
//
// The events are the fields of dedup.Stats (the keys of Stats.Map). Sum
// over processes in PromQL; the fold ratio of a type is, for example,
//
//	sum by (type) (rate(dedup_events_total{event=~"replaced|merged|deferred"}[5m]))
//	  / sum by (type) (rate(dedup_events_total{event=~"locked|replaced|merged|deferred|duplicate"}[5m]))
package dedupprom

import (
	"github.com/asynq-dedup/dedup"
	"github.com/prometheus/client_golang/prometheus"
)

// MetricName is the name of the counter the collector exports (before any
// namespace).
const MetricName = "dedup_events_total"

// Collector is a prometheus.Collector of one Dedup's counters. It reads
// Dedup.StatsByType on every scrape and keeps no state of its own.
type Collector struct {
	d    *dedup.Dedup
	desc *prometheus.Desc
}

// Option configures a Collector.
type Option func(*options)

type options struct {
	namespace   string
	constLabels prometheus.Labels
}

// WithNamespace prefixes the metric name: "<ns>_dedup_events_total".
// Default: no namespace.
func WithNamespace(ns string) Option {
	return func(o *options) { o.namespace = ns }
}

// WithConstLabels adds fixed labels to every metric, to tell apart several
// Dedups registered with one registry (which would collide otherwise).
// Default: none.
func WithConstLabels(l prometheus.Labels) Option {
	return func(o *options) { o.constLabels = l }
}

// NewCollector returns a collector of d's per-type event counters, to
// register with a prometheus.Registerer.
func NewCollector(d *dedup.Dedup, opts ...Option) *Collector {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	return &Collector{
		d: d,
		desc: prometheus.NewDesc(
			prometheus.BuildFQName(o.namespace, "", MetricName),
			"Deduplication events of this process by task type (asynq-dedup); see dedup.Stats for their meaning.",
			[]string{"type", "event"}, o.constLabels),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for typ, s := range c.d.StatsByType() {
		for event, n := range s.Map() {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(n), typ, event)
		}
	}
}

var _ prometheus.Collector = (*Collector)(nil)
