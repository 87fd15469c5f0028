package dedup

import (
	"context"
	"reflect"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"google.golang.org/protobuf/encoding/protowire"
)

// Direct enqueue: for a Client from Dedup.NewClient (whose asynq client
// shares the Dedup's Redis) and a task that carries no options from
// asynq.NewTask (which the wrapper cannot see), the
// acquire script writes asynq's task record itself, in the same atomic step
// that takes the lock: one round trip for an accepted enqueue instead of
// two, and no window in which the lock exists without its task. It writes
// exactly what asynq v0.26.0's own enqueue and schedule scripts write;
// TestDirectEnqueueMatchesAsynq compares the two field by field.

// asynq v0.26.0 defaults (client.go composeOptions).
const (
	asynqDefaultMaxRetry = 25
	asynqDefaultTimeout  = 30 * time.Minute
)

// directMsg is what the direct path stores, in asynq's terms.
type directMsg struct {
	typ       string
	payload   []byte
	headers   map[string]string
	id        string
	queue     string
	retry     int
	timeout   time.Duration
	deadline  time.Time
	retention time.Duration
	processAt time.Time // zero or past: pending now
}

// encode marshals the message as asynq's TaskMessage protobuf (field numbers
// from asynq's internal/proto/asynq.proto; proto3: zero values omitted).
func (m *directMsg) encode() []byte {
	b := make([]byte, 0, 64+len(m.payload)+len(m.typ)+len(m.id)+len(m.queue))
	str := func(num protowire.Number, s string) {
		if s != "" {
			b = protowire.AppendTag(b, num, protowire.BytesType)
			b = protowire.AppendString(b, s)
		}
	}
	varint := func(num protowire.Number, v int64) {
		if v != 0 {
			b = protowire.AppendTag(b, num, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(v))
		}
	}
	str(1, m.typ)
	if len(m.payload) > 0 {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, m.payload)
	}
	str(3, m.id)
	str(4, m.queue)
	varint(5, int64(m.retry))
	varint(8, int64(m.timeout/time.Second))
	if !m.deadline.IsZero() {
		varint(9, m.deadline.Unix())
	}
	varint(12, int64(m.retention/time.Second))
	for k, v := range m.headers {
		var e []byte
		if k != "" {
			e = protowire.AppendTag(e, 1, protowire.BytesType)
			e = protowire.AppendString(e, k)
		}
		if v != "" {
			e = protowire.AppendTag(e, 2, protowire.BytesType)
			e = protowire.AppendString(e, v)
		}
		b = protowire.AppendTag(b, 15, protowire.BytesType)
		b = protowire.AppendBytes(b, e)
	}
	return b
}

// info is the TaskInfo asynq's client would return for the message.
func (m *directMsg) info() *asynq.TaskInfo {
	ti := &asynq.TaskInfo{
		ID: m.id, Queue: m.queue, Type: m.typ, Payload: m.payload, Headers: m.headers,
		MaxRetry: m.retry, Timeout: m.timeout, Retention: m.retention,
		State: asynq.TaskStatePending, NextProcessAt: time.Now(),
	}
	if !m.deadline.IsZero() {
		ti.Deadline = time.Unix(m.deadline.Unix(), 0)
	}
	if m.scheduled() {
		ti.State, ti.NextProcessAt = asynq.TaskStateScheduled, m.processAt
	}
	return ti
}

func (m *directMsg) scheduled() bool { return !m.processAt.IsZero() && m.processAt.After(time.Now()) }

// taskOptsField reads the length of asynq.Task's unexported opts (options
// given to NewTask). ok is false if the field is not there (a changed asynq):
// then the direct path is never taken.
func taskOptsLen(t *asynq.Task) (n int, ok bool) {
	f := reflect.ValueOf(t).Elem().FieldByName("opts")
	if !f.IsValid() || f.Kind() != reflect.Slice {
		return 0, false
	}
	return f.Len(), true
}

// directCall collects, while the wrapper reads a call's asynq options, what
// the direct path needs; unknown means an option it cannot reproduce.
type directCall struct {
	msg     directMsg
	unknown bool
}

func (dc *directCall) option(o asynq.Option) {
	switch o.Type() {
	case asynq.MaxRetryOpt:
		if v, ok := o.Value().(int); ok {
			dc.msg.retry = v
			return
		}
	case asynq.TimeoutOpt:
		if v, ok := o.Value().(time.Duration); ok {
			dc.msg.timeout = v
			return
		}
	case asynq.DeadlineOpt:
		if v, ok := o.Value().(time.Time); ok {
			dc.msg.deadline = v
			return
		}
	case asynq.RetentionOpt:
		if v, ok := o.Value().(time.Duration); ok {
			dc.msg.retention = v
			return
		}
	case asynq.QueueOpt, asynq.TaskIDOpt, asynq.ProcessAtOpt, asynq.ProcessInOpt:
		return // read by the wrapper itself
	default:
		if o.Type() == OptionType {
			return
		}
	}
	dc.unknown = true
}

// prepare finishes the message like asynq's client does, or reports that the
// direct path does not apply.
func (c *Client) prepareDirect(dc *directCall, task *asynq.Task, id, queue string, explicitQueue bool, processAt time.Time) ([]byte, bool) {
	if !c.direct || dc.unknown || strings.TrimSpace(task.Type()) == "" {
		return nil, false
	}
	if !explicitQueue && queue != "default" {
		return nil, false // the remembered queue came from NewTask options: asynq's path
	}
	if n, ok := taskOptsLen(task); !ok || n > 0 {
		return nil, false
	}
	m := &dc.msg
	m.typ, m.payload, m.headers, m.id, m.queue, m.processAt = task.Type(), task.Payload(), task.Headers(), id, queue, processAt
	if m.retry < 0 {
		m.retry = 0
	}
	if m.deadline.IsZero() && m.timeout == 0 {
		m.timeout = asynqDefaultTimeout
	}
	return m.encode(), true
}

// publishQueue registers the queue in asynq's set of queues once per
// process, as asynq's client does before its first enqueue to a queue.
func (c *Client) publishQueue(ctx context.Context, queue string) error {
	if _, ok := c.published.Load(queue); ok {
		return nil
	}
	if _, err := c.d.call(ctx, func(cctx context.Context) (any, error) {
		return nil, c.d.rdb.SAdd(cctx, "asynq:queues", queue).Err()
	}); err != nil {
		return err
	}
	c.published.Store(queue, true)
	return nil
}
