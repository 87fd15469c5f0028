package lockview

import (
	"reflect"

	"github.com/asynq-dedup/dedup"
)

// EventNames are the names of the counters of dedup.Stats, its fields'
// "event" tags, in the order of its fields (the order dedupctl stats
// prints them in).
func EventNames() []string {
	t := reflect.TypeFor[dedup.Stats]()
	out := make([]string, t.NumField())
	for i := range out {
		out[i] = t.Field(i).Tag.Get("event")
	}
	return out
}
