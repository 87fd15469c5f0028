package store

import (
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// What this package knows of asynq v0.26.0's own records (internal/base and
// internal/proto/asynq.proto). TestAsynqLayoutPinned (root package) and the
// direct-enqueue comparison tests guard it.
//
// A task is the hash TaskKey(queue, id) with the fields "msg" (a
// TaskMessage protobuf), "state" (one of the states below) and, while
// pending, "pending_since" (unix nanoseconds). Its ID is also in the list or
// sorted set its state names (PendingKey, ScheduledKey, ...).

// AsynqVersion is the asynq release whose layout this package reads and
// writes (asynq.Version, without the "v").
const AsynqVersion = "0.26.0"

// asynq's defaults for a task enqueued without options (client.go).
const (
	DefaultMaxRetry = 25
	DefaultTimeout  = 30 * time.Minute
)

// Task states as asynq stores them in the "state" field.
const (
	StatePending   = "pending"
	StateScheduled = "scheduled"
	StateRetry     = "retry"
	StateActive    = "active"
	StateCompleted = "completed"
	StateArchived  = "archived"
)

// TaskMessage field numbers.
const (
	fieldType      protowire.Number = 1
	fieldPayload   protowire.Number = 2
	fieldID        protowire.Number = 3
	fieldQueue     protowire.Number = 4
	fieldRetry     protowire.Number = 5
	fieldTimeout   protowire.Number = 8
	fieldDeadline  protowire.Number = 9
	fieldUniqueKey protowire.Number = 10
	fieldRetention protowire.Number = 12
	fieldHeaders   protowire.Number = 15
)

// Message is a new task as asynq's client stores it (TaskMessage), for the
// direct path, which stores accepted tasks itself.
type Message struct {
	Type      string
	Payload   []byte
	Headers   map[string]string
	ID        string
	Queue     string
	Retry     int
	Timeout   time.Duration // whole seconds are stored
	Deadline  time.Time     // unix seconds are stored; zero: none
	Retention time.Duration // whole seconds are stored
	UniqueKey string        // the lock asynq's scripts release with the task ("" none)
}

// Encode marshals m the way asynq's client does (proto3: zero values
// omitted; fields in number order).
func (m *Message) Encode() []byte {
	size := 64 + len(m.Payload) + len(m.Type) + len(m.ID) + len(m.Queue) + len(m.UniqueKey)
	for k, v := range m.Headers {
		size += len(k) + len(v) + 16
	}
	b := make([]byte, 0, size) // (room for it all: one allocation)
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
	str(fieldType, m.Type)
	if len(m.Payload) > 0 {
		b = protowire.AppendTag(b, fieldPayload, protowire.BytesType)
		b = protowire.AppendBytes(b, m.Payload)
	}
	str(fieldID, m.ID)
	str(fieldQueue, m.Queue)
	varint(fieldRetry, int64(m.Retry))
	varint(fieldTimeout, int64(m.Timeout/time.Second))
	if !m.Deadline.IsZero() {
		varint(fieldDeadline, m.Deadline.Unix())
	}
	str(fieldUniqueKey, m.UniqueKey)
	varint(fieldRetention, int64(m.Retention/time.Second))
	for k, v := range m.Headers {
		var e []byte
		if k != "" {
			e = protowire.AppendTag(e, 1, protowire.BytesType)
			e = protowire.AppendString(e, k)
		}
		if v != "" {
			e = protowire.AppendTag(e, 2, protowire.BytesType)
			e = protowire.AppendString(e, v)
		}
		b = protowire.AppendTag(b, fieldHeaders, protowire.BytesType)
		b = protowire.AppendBytes(b, e)
	}
	return b
}

// appendPayloadField appends p as an encoded TaskMessage field 2.
func appendPayloadField(b, p []byte) []byte {
	b = protowire.AppendTag(b, fieldPayload, protowire.BytesType)
	return protowire.AppendBytes(b, p)
}

// typeField is a TaskMessage's encoded type field, which asynq's messages
// begin with: a script compares a stored message's first bytes with it to
// fold only into a task of the same type.
func typeField(typ string) []byte {
	b := protowire.AppendTag(make([]byte, 0, len(typ)+3), fieldType, protowire.BytesType)
	return protowire.AppendString(b, typ)
}

// MessageType returns the task type of a stored TaskMessage, or "" if msg
// is not one.
func MessageType(msg string) string {
	typ, _, _ := decodeTypePayload([]byte(msg))
	return typ
}

// MessageHeaders returns the headers of a stored TaskMessage (nil if there
// are none, or msg is not one).
func MessageHeaders(b []byte) map[string]string {
	var h map[string]string
	for len(b) > 0 {
		num, wt, n := protowire.ConsumeTag(b)
		if n < 0 {
			return h
		}
		b = b[n:]
		if num != fieldHeaders || wt != protowire.BytesType {
			m := protowire.ConsumeFieldValue(num, wt, b)
			if m < 0 {
				return h
			}
			b = b[m:]
			continue
		}
		e, m := protowire.ConsumeBytes(b)
		if m < 0 {
			return h
		}
		b = b[m:]
		k, v := mapEntry(e)
		if h == nil {
			h = map[string]string{}
		}
		h[k] = v
	}
	return h
}

// mapEntry reads the key and value of an encoded map<string, string> entry.
func mapEntry(e []byte) (k, v string) {
	for len(e) > 0 {
		num, wt, n := protowire.ConsumeTag(e)
		if n < 0 {
			return k, v
		}
		e = e[n:]
		m := protowire.ConsumeFieldValue(num, wt, e)
		if m < 0 {
			return k, v
		}
		if wt == protowire.BytesType {
			s, _ := protowire.ConsumeBytes(e)
			if num == 1 {
				k = string(s)
			} else if num == 2 {
				v = string(s)
			}
		}
		e = e[m:]
	}
	return k, v
}

// decodeTypePayload reads the type and payload of a TaskMessage.
func decodeTypePayload(b []byte) (typ string, payload []byte, ok bool) {
	for len(b) > 0 {
		num, wt, n := protowire.ConsumeTag(b)
		if n < 0 {
			return "", nil, false
		}
		b = b[n:]
		if wt == protowire.BytesType && (num == fieldType || num == fieldPayload) {
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return "", nil, false
			}
			if num == fieldType {
				typ = string(v)
			} else {
				payload = v
			}
			b = b[m:]
			continue
		}
		m := protowire.ConsumeFieldValue(num, wt, b)
		if m < 0 {
			return "", nil, false
		}
		b = b[m:]
	}
	return typ, payload, true
}

// Waiting reports whether a task state means "not started yet": the task
// may still be folded into.
func Waiting(state string) bool {
	return state == StatePending || state == StateScheduled || state == StateRetry
}

// Gone reports whether a task state ("" for no record) means the task will
// never run again, so a lock it owns is orphaned.
func Gone(state string) bool {
	return state == "" || state == StateCompleted || state == StateArchived
}
