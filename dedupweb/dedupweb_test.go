package dedupweb_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"html"
	"log/slog"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/dedupweb"
	"github.com/asynq-dedup/dedup/dedupweb/internal/webtest"
	"github.com/asynq-dedup/dedup/internal/redistest"
	"github.com/asynq-dedup/dedup/internal/store"
	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
)

// The overview counts the locks of each queue and type by state (one in
// every state, made by a real asynq server with the middleware), and draws
// the per-minute counters the flusher wrote.
func TestOverviewCounts(t *testing.T) {
	w := webtest.New(t)
	w.Populate()
	if _, err := w.Client.Enqueue(asynq.NewTask("email:welcome", []byte(`{"user_id":1}`)), asynq.Queue(w.QA), dedup.Fields("user_id")); !errors.Is(err, asynq.ErrDuplicateTask) {
		t.Fatalf("the duplicate: %v", err)
	}
	if err := w.D.FlushStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv := w.Serve(dedupweb.Options{})
	code, body := get(t, http.DefaultClient, srv.URL+"/")
	if code != http.StatusOK {
		t.Fatalf("overview: %d\n%s", code, body)
	}
	for _, c := range []struct{ queue, typ, state, want string }{
		// The orphan's type went with its holder's record: a plain lock keeps none.
		{w.QA, "email:welcome", "waiting", "2"}, {w.QA, "email:welcome", "orphaned", "0"}, {w.QA, "", "orphaned", "1"},
		{w.QB, webtest.TypeBlock, "running", "1"}, {w.QB, webtest.TypeFail, "retry-wait", "1"},
		{w.QB, webtest.TypeCool, "cooling", "1"}, {w.QB, webtest.TypeCool, "waiting", "0"},
	} {
		if got := cell(t, body, c.queue, c.typ, c.state); got != c.want {
			t.Errorf("overview %s / %s %s = %s, want %s", c.queue, c.typ, c.state, got, c.want)
		}
	}
	if !strings.Contains(body, `data-total="all">6<`) {
		t.Errorf("overview total is not 6:\n%s", body)
	}
	// email:welcome: 3 locked, 1 duplicate, counted in this minute.
	for _, want := range []string{`data-series="locked"><div><strong>locked</strong> <span class="n">3</span>`,
		`data-series="duplicate"><div><strong>duplicate</strong> <span class="n">1</span>`, "<svg viewBox=\"0 0 120 24\"", "<rect x="} {
		if !strings.Contains(body, want) {
			t.Errorf("overview charts lack %q", want)
		}
	}
}

// Search finds user 42's lock by type and field, by its task ID and by its
// key; a free key says so.
func TestSearchFindsAUsersLock(t *testing.T) {
	w := webtest.New(t)
	w.Enqueue(w.QA, "email:welcome", 41)
	info := w.Enqueue(w.QA, "email:welcome", 42)
	srv := w.Serve(dedupweb.Options{})
	lockPath := "/lock?" + url.Values{"key": {w.LockOf(info)}}.Encode()
	for name, q := range map[string]url.Values{
		"fields": {"type": {"email:welcome"}, "field": {"user_id=42"}, "queue": {w.QA}},
		"lines":  {"type": {"email:welcome"}, "field": {"\r\nuser_id=42\r\n"}, "queue": {w.QA}},
		"task":   {"task": {info.ID}},
		"lock":   {"lock": {w.LockOf(info)}},
	} {
		resp, err := noRedirect.Get(srv.URL + "/search?" + q.Encode())
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != lockPath {
			t.Errorf("search by %s: %d to %q, want 303 to %q", name, resp.StatusCode, resp.Header.Get("Location"), lockPath)
		}
	}
	code, body := get(t, http.DefaultClient, srv.URL+"/search?"+url.Values{"type": {"email:welcome"}, "field": {"user_id=42"}, "queue": {w.QA}}.Encode())
	if code != http.StatusOK || !strings.Contains(body, info.ID) {
		t.Errorf("search followed: %d, holder %s missing", code, info.ID)
	}
	code, body = get(t, http.DefaultClient, srv.URL+"/search?"+url.Values{"type": {"email:welcome"}, "field": {"user_id=43"}, "queue": {w.QA}}.Encode())
	if code != http.StatusNotFound || !strings.Contains(body, "no lock: the key is free") {
		t.Errorf("search of a free key: %d\n%s", code, body)
	}
	code, body = get(t, http.DefaultClient, srv.URL+"/search?"+url.Values{"type": {"email:welcome"}}.Encode())
	if code != http.StatusBadRequest || !strings.Contains(body, "give one of --field, --payload or --key") {
		t.Errorf("search without a key: %d\n%s", code, body)
	}
}

// Search by type and key without a queue looks in every queue, as dedupctl
// lookup does: a lock held in a queue other than default opens; a key with
// a lock in several queues lists each; a free key says where it looked.
func TestSearchWithoutQueueFindsTheLockInAnyQueue(t *testing.T) {
	w := webtest.New(t)
	a := w.Enqueue(w.QA, "email:welcome", 42)
	srv := w.Serve(dedupweb.Options{})
	search := srv.URL + "/search?" + url.Values{"type": {"email:welcome"}, "field": {"user_id=42"}}.Encode()
	resp, err := noRedirect.Get(search)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	lockPath := "/lock?" + url.Values{"key": {w.LockOf(a)}}.Encode()
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != lockPath {
		t.Errorf("search of a lock in queue %s: %d to %q, want 303 to %q", w.QA, resp.StatusCode, resp.Header.Get("Location"), lockPath)
	}
	b := w.Enqueue(w.QB, "email:welcome", 42)
	code, body := get(t, http.DefaultClient, search)
	if code != http.StatusOK || !strings.Contains(body, `<p id="found">The key has a lock in each of 2 queues:</p>`) {
		t.Errorf("search of a key with a lock in %s and %s: %d\n%s", w.QA, w.QB, code, body)
	}
	for _, info := range []*asynq.TaskInfo{a, b} {
		href := `href="/lock?` + url.Values{"key": {w.LockOf(info)}}.Encode() + `"`
		if !strings.Contains(body, href) {
			t.Errorf("search lists no link %s:\n%s", href, body)
		}
	}
	code, body = get(t, http.DefaultClient, srv.URL+"/search?"+url.Values{"type": {"email:welcome"}, "field": {"user_id=43"}}.Encode())
	if code != http.StatusNotFound || !strings.Contains(body, "no lock: the key is free in every queue (") || !strings.Contains(body, w.QA) {
		t.Errorf("search of a free key in every queue: %d\n%s", code, body)
	}
}

// A lock's page shows its holder with the holder's state in asynq (linked
// to asynqmon), folds, age, TTL and, for a key with modes (here a failure
// hold), the key form by field names and the policy; never the payload
// unless a formatter is given.
func TestLockPage(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "email:welcome", 42, dedup.OnFailure(dedup.FailHold, time.Hour))
	w.Enqueue(w.QA, "email:welcome", 42, dedup.OnConflict(dedup.Replace))
	srv := w.Serve(dedupweb.Options{AsynqmonRoot: "/monitoring/"})
	code, body := get(t, http.DefaultClient, srv.URL+"/lock?"+url.Values{"key": {w.LockOf(info)}}.Encode())
	if code != http.StatusOK {
		t.Fatalf("lock page: %d\n%s", code, body)
	}
	for _, want := range []string{
		`<a href="/monitoring/queues/` + w.QA + `/tasks/` + info.ID + `">` + info.ID + `</a>`,
		"<dt>holder in asynq</dt><dd>pending (retried 0/25)</dd>", "<dt>keyed on</dt><dd>fields user_id</dd>",
		"<dt>folds</dt><dd>1</dd>", "<dt>state</dt><dd><span class=\"state state-waiting\">waiting</span>",
		"<dt>age</dt><dd>", "<dt>TTL left</dt><dd>", "<dt>follow-up</dt><dd>-</dd>", "<dt>on failure</dt><dd>hold 1h00m</dd>",
		`<dt>mode record</dt><dd class="mono" id="mode">` + store.ModeOf(w.LockOf(info)) + "</dd>",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("lock page lacks %q", want)
		}
	}
	for _, leak := range []string{"user42@example.com", "Holder&#39;s payload", "Release this lock"} {
		if strings.Contains(body, leak) {
			t.Errorf("lock page shows %q", leak)
		}
	}
	srv = w.Serve(dedupweb.Options{PayloadFormatter: dedupweb.PayloadFormatterFunc(func(typ string, p []byte) string {
		return typ + ": " + string(p)
	})})
	_, body = get(t, http.DefaultClient, srv.URL+"/lock?"+url.Values{"key": {w.LockOf(info)}}.Encode())
	if !strings.Contains(body, `<pre id="payload">email:welcome: {&#34;user_id&#34;:42,&#34;email&#34;:&#34;user42@example.com&#34;}</pre>`) {
		t.Errorf("lock page with a formatter lacks the payload:\n%s", body)
	}
	code, _ = get(t, http.DefaultClient, srv.URL+"/lock?key=nope")
	if code != http.StatusBadRequest {
		t.Errorf("lock page of a bad key: %d", code)
	}
}

// A plain lock (no policy beside the lock) has no mode record: its page
// says so, and shows what asynq says of its holder: the holder's state,
// and its type from the holder's record.
func TestLockPageOfAPlainLockShowsItsHoldersState(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "email:welcome", 42)
	srv := w.Serve(dedupweb.Options{})
	code, body := get(t, http.DefaultClient, srv.URL+"/lock?"+url.Values{"key": {w.LockOf(info)}}.Encode())
	if code != http.StatusOK {
		t.Fatalf("lock page: %d\n%s", code, body)
	}
	for _, want := range []string{"<dt>holder in asynq</dt><dd>pending (retried 0/25)</dd>",
		`<dt>type</dt><dd class="mono">email:welcome</dd>`, "<dt>keyed on</dt><dd>-</dd>",
		`<dt>mode record</dt><dd id="mode">none: a plain lock, whose state is its holder&#39;s in asynq</dd>`,
		"<dt>state</dt><dd><span class=\"state state-waiting\">waiting</span>"} {
		if !strings.Contains(body, want) {
			t.Errorf("plain lock page lacks %q", want)
		}
	}
	if strings.Contains(body, "Raw fields") {
		t.Error("plain lock page shows a mode record's fields")
	}
}

// Read-only (the zero Options): no release button, and every POST and
// action page refused, the lock untouched.
func TestReadOnlyRefusesActions(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "email:welcome", 1)
	key := w.LockOf(info)
	var logs bytes.Buffer
	srv := w.Serve(dedupweb.Options{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	_, body := get(t, http.DefaultClient, srv.URL+"/lock?"+url.Values{"key": {key}}.Encode())
	if strings.Contains(body, "Release") || strings.Contains(body, "<form method=\"post\"") {
		t.Errorf("read-only lock page offers a release:\n%s", body)
	}
	form := url.Values{"key": {key}, "holder": {info.ID}}
	for _, path := range []string{"/release", "/doctor/fix", "/locks", "/"} {
		if code, _ := post(t, srv.URL+path, form, nil); code != http.StatusForbidden {
			t.Errorf("read-only POST %s: %d, want 403", path, code)
		}
	}
	if code, _ := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {key}}.Encode()); code != http.StatusForbidden {
		t.Errorf("read-only GET /release: %d, want 403", code)
	}
	if !w.Exists(key) {
		t.Fatal("a read-only handler released the lock")
	}
	if !strings.Contains(logs.String(), "result=refused reason=read-only") {
		t.Errorf("refusals not logged:\n%s", logs.String())
	}
	if code, _ := post(t, w.Serve(dedupweb.Options{AllowRelease: true}).URL+"/locks", nil, nil); code != http.StatusMethodNotAllowed {
		t.Errorf("POST to a page with releases allowed: %d, want 405", code)
	}
}

// A release needs the confirmation page's token: none, a forged one, one
// of another lock, or a post from another site are refused; the real one
// releases, holder-checked, and is logged.
func TestReleaseNeedsTheCSRFToken(t *testing.T) {
	w := webtest.New(t)
	info, other := w.Enqueue(w.QA, "email:welcome", 1), w.Enqueue(w.QA, "email:welcome", 2)
	key := w.LockOf(info)
	var logs bytes.Buffer
	srv := w.Serve(dedupweb.Options{AllowRelease: true, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	_, page := get(t, http.DefaultClient, srv.URL+"/lock?"+url.Values{"key": {key}}.Encode())
	if !strings.Contains(page, `id="release" href="/release?key=`) {
		t.Fatalf("lock page has no release link:\n%s", page)
	}
	_, confirm := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {key}}.Encode())
	form := hidden(confirm)
	if form.Get("csrf") == "" || form.Get("holder") != info.ID || form.Get("key") != key {
		t.Fatalf("confirmation form %v:\n%s", form, confirm)
	}
	_, otherConfirm := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {w.LockOf(other)}}.Encode())
	bad := map[string]url.Values{
		"no token":      without(form, "csrf"),
		"forged token":  with(form, "csrf", "1700000000.00"),
		"other's token": with(form, "csrf", hidden(otherConfirm).Get("csrf")),
		"other holder":  with(form, "holder", other.ID),
	}
	for name, f := range bad {
		if code, body := post(t, srv.URL+"/release", f, nil); code != http.StatusForbidden || !strings.Contains(body, "CSRF token") {
			t.Errorf("%s: %d, want 403 naming the token\n%s", name, code, body)
		}
	}
	if code, _ := post(t, srv.URL+"/release", form, http.Header{"Origin": {"http://evil.example"}}); code != http.StatusForbidden {
		t.Errorf("cross-site post: %d, want 403", code)
	}
	if !w.Exists(key) {
		t.Fatal("a refused post released the lock")
	}
	code, body := post(t, srv.URL+"/release", form, http.Header{"Origin": {srv.URL}})
	if code != http.StatusOK || !strings.Contains(body, "released "+key) || w.Exists(key) {
		t.Fatalf("release with the token: %d, lock there %v\n%s", code, w.Exists(key), body)
	}
	if !w.Exists(w.LockOf(other)) {
		t.Error("the other lock went too")
	}
	if code, body := post(t, srv.URL+"/release", form, nil); code != http.StatusNotFound || !strings.Contains(body, "no such lock") {
		t.Errorf("second release: %d\n%s", code, body)
	}
	if !strings.Contains(logs.String(), "result=released action=release key="+key) || !strings.Contains(logs.String(), "remote_addr=127.0.0.1:") {
		t.Errorf("release not logged with who and what:\n%s", logs.String())
	}
}

// The token binds the holder shown: a lock taken by another task since the
// confirmation is not released.
func TestReleaseIsOwnerChecked(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "email:welcome", 1)
	key := w.LockOf(info)
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	_, confirm := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {key}}.Encode())
	form := hidden(confirm)
	if err := w.RDB.SetArgs(context.Background(), key, "someone-else", redis.SetArgs{KeepTTL: true}).Err(); err != nil {
		t.Fatal(err)
	}
	if code, body := post(t, srv.URL+"/release", form, nil); code != http.StatusConflict || !strings.Contains(body, "changed holder") {
		t.Errorf("release after the holder changed: %d\n%s", code, body)
	}
	if !w.Exists(key) {
		t.Fatal("the lock of another holder was released")
	}
}

// Authorize guards the actions (and, with AuthorizePages, every page).
func TestAuthorize(t *testing.T) {
	w := webtest.New(t)
	key := w.LockOf(w.Enqueue(w.QA, "email:welcome", 1))
	deny := func(r *http.Request) error {
		if r.Header.Get("X-Admin") == "" {
			return errors.New("admins only")
		}
		return nil
	}
	srv := w.Serve(dedupweb.Options{AllowRelease: true, Authorize: deny})
	if code, body := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {key}}.Encode()); code != http.StatusForbidden || !strings.Contains(body, "admins only") {
		t.Errorf("unauthorized confirmation page: %d", code)
	}
	if code, _ := get(t, http.DefaultClient, srv.URL+"/"); code != http.StatusOK {
		t.Errorf("pages need no authorization by default: %d", code)
	}
	srv = w.Serve(dedupweb.Options{Authorize: deny, AuthorizePages: true})
	if code, _ := get(t, http.DefaultClient, srv.URL+"/"); code != http.StatusForbidden {
		t.Errorf("AuthorizePages: %d, want 403", code)
	}
}

// A type named like a script renders as text on every page.
func TestNamesAreEscaped(t *testing.T) {
	w := webtest.New(t)
	const evil = `<script>alert(1)</script>`
	info := w.Enqueue(w.QA, evil, 1)
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	for _, path := range []string{"/", "/locks", "/lock?" + url.Values{"key": {w.LockOf(info)}}.Encode(),
		"/release?" + url.Values{"key": {w.LockOf(info)}}.Encode(), "/search?" + url.Values{"type": {evil}, "field": {"user_id=2"}, "queue": {w.QA}}.Encode()} {
		_, body := get(t, http.DefaultClient, srv.URL+path)
		if strings.Contains(body, "<script") {
			t.Errorf("%s renders a script tag", path)
		}
		if !strings.Contains(body, "&lt;script&gt;alert(1)&lt;/script&gt;") {
			t.Errorf("%s does not show the type as text", path)
		}
	}
}

// The list pages by SCAN cursor: following Next shows every lock once.
func TestLocksPaging(t *testing.T) {
	w := webtest.New(t)
	want := map[string]bool{}
	for u := range 12 {
		want[w.LockOf(w.Enqueue(w.QA, "email:welcome", u))] = true
	}
	srv := w.Serve(dedupweb.Options{PageSize: 5, RootPath: "/dedup"})
	seen := map[string]bool{}
	next, pages := "/dedup/locks?queue="+w.QA, 0
	for next != "" {
		pages++
		_, body := get(t, http.DefaultClient, srv.URL+unescape(next))
		keys := linkedKeys(body)
		if len(keys) > 5 {
			t.Fatalf("page %d shows %d locks, more than 5", pages, len(keys))
		}
		for _, k := range keys {
			if seen[k] {
				t.Errorf("lock %s shown twice", k)
			}
			seen[k] = true
		}
		next = nextLink(body)
		if pages > 20 {
			t.Fatal("paging never ends")
		}
	}
	if len(seen) != len(want) || pages < 3 {
		t.Errorf("paging showed %d of %d locks in %d pages", len(seen), len(want), pages)
	}
	code, _ := get(t, http.DefaultClient, srv.URL+"/dedup/locks?cursor=x")
	if code != http.StatusBadRequest {
		t.Errorf("bad cursor: %d", code)
	}
	if code, _ := get(t, http.DefaultClient, srv.URL+"/locks"); code != http.StatusNotFound {
		t.Errorf("outside RootPath: %d, want 404", code)
	}
}

// The doctor lists an orphan, and its fix releases it after confirmation.
func TestDoctorAndFix(t *testing.T) {
	w := webtest.New(t)
	orphan, alive := w.Enqueue(w.QA, "email:welcome", 1), w.Enqueue(w.QA, "email:welcome", 2)
	w.Orphan(orphan)
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	_, body := get(t, http.DefaultClient, srv.URL+"/doctor")
	if !strings.Contains(body, "holder missing, lock younger than --grace 1m00s") || strings.Contains(body, `id="fix"`) {
		t.Errorf("doctor with the default grace should leave the young orphan alone:\n%s", body)
	}
	_, body = get(t, http.DefaultClient, srv.URL+"/doctor?grace=0s")
	if !strings.Contains(body, orphan.ID) || strings.Contains(body, alive.ID) || !strings.Contains(body, `id="fix"`) {
		t.Fatalf("doctor --grace 0:\n%s", body)
	}
	_, confirm := get(t, http.DefaultClient, srv.URL+"/doctor/fix?grace=0s")
	form := hidden(confirm)
	w.PastTheSecond(orphan)
	if code, _ := post(t, srv.URL+"/doctor/fix", without(form, "csrf"), nil); code != http.StatusForbidden || !w.Exists(w.LockOf(orphan)) {
		t.Fatalf("doctor fix without a token: %d", code)
	}
	code, body := post(t, srv.URL+"/doctor/fix", form, nil)
	if code != http.StatusOK || !strings.Contains(body, "1 released") || w.Exists(w.LockOf(orphan)) || !w.Exists(w.LockOf(alive)) {
		t.Fatalf("doctor fix: %d\n%s", code, errorText(body))
	}
}

func without(v url.Values, name string) url.Values {
	out := url.Values{}
	for k, vs := range v {
		if k != name {
			out[k] = vs
		}
	}
	return out
}

func with(v url.Values, name, value string) url.Values {
	out := without(v, name)
	out.Set(name, value)
	return out
}

// Releasing what the doctor found never releases a lock a policy keeps,
// though its holder cannot run: a cooling key, a fail hold (holder
// archived, or deleted since) and a Scheduler firing's key stay, with
// their values, while a true orphan (its holder vanished) is released.
func TestDoctorFixLeavesHoldsAlone(t *testing.T) {
	w := webtest.New(t)
	holds := w.MakeHolds()
	kept := append([]string{holds.Cooling, holds.Failed, holds.FailedGone}, holds.Firings...)
	before := w.Values(kept...)
	orphan := w.Orphaned(w.QA, "email:welcome", 1)
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	_, body := get(t, http.DefaultClient, srv.URL+"/doctor?grace=0s")
	if !strings.Contains(body, "1 whose holder cannot run") || !strings.Contains(body, html.EscapeString(w.LockOf(orphan))) {
		t.Fatalf("doctor should find the orphan alone:\n%s", errorText(body))
	}
	for _, k := range kept {
		if strings.Contains(body, html.EscapeString(k)) {
			t.Errorf("doctor lists %s, which a policy keeps", k)
		}
	}
	_, confirm := get(t, http.DefaultClient, srv.URL+"/doctor/fix?grace=0s")
	form := hidden(confirm)
	if keys := form["key"]; len(keys) != 1 || keys[0] != w.LockOf(orphan) {
		t.Fatalf("the fix would release %v, want only the orphan %s", keys, w.LockOf(orphan))
	}
	code, body := post(t, srv.URL+"/doctor/fix", form, nil)
	if code != http.StatusOK || !strings.Contains(body, "1 released") || w.Exists(w.LockOf(orphan)) {
		t.Fatalf("doctor fix: %d, orphan there %v\n%s", code, w.Exists(w.LockOf(orphan)), errorText(body))
	}
	if after := w.Values(kept...); !slices.Equal(after, before) {
		t.Errorf("the holds changed: %q, were %q", after, before)
	}
	_, confirm = get(t, http.DefaultClient, srv.URL+"/doctor/fix?grace=0s")
	if keys := hidden(confirm)["key"]; len(keys) != 0 {
		t.Errorf("after the fix, the doctor still finds %v", keys)
	}
}

// A lock's page prints the key's policies in words only: what it does
// while its task runs, a cooldown, a fail hold, a period's window, the
// waiting set; never the mode record's codes.
func TestLockPagePrintsPoliciesInWordsOnly(t *testing.T) {
	w := webtest.NewWithRules(t, map[string]dedup.Rule{
		"report:build":  {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
		"report:live":   {Fields: []string{"user_id"}, OnRunning: dedup.RunningAllow},
		"digest:weekly": {Fields: []string{"user_id"}, Cooldown: time.Hour},
		"crm:sync":      {Fields: []string{"user_id"}, OnFailure: dedup.FailHoldUntilReleased, MaxPending: 3},
		"stats:daily":   {Fields: []string{"user_id"}, Period: 24 * time.Hour},
	})
	srv := w.Serve(dedupweb.Options{})
	for typ, want := range map[string][]string{
		"report:build":  {"<dt>while running</dt><dd>defer: a duplicate enqueued while the holder runs becomes its one follow-up, queued when the run ends</dd>"},
		"report:live":   {"<dt>while running</dt><dd>allow: the key frees when its task starts, so a duplicate enqueued while it runs is a new task</dd>"},
		"digest:weekly": {"<dt>cooldown left</dt><dd>59m"},
		"crm:sync":      {"<dt>on failure</dt><dd>hold until released</dd>", "<dt>waiting set</dt>"},
		"stats:daily":   {"<dt>window</dt><dd>"},
	} {
		info := w.Enqueue(w.QA, typ, 1)
		fields, err := w.RDB.HGetAll(context.Background(), store.ModeOf(w.LockOf(info))).Result()
		if err != nil || len(fields) == 0 {
			t.Fatalf("%s: no mode record to print (%v)", typ, err)
		}
		_, body := get(t, http.DefaultClient, srv.URL+"/lock?"+url.Values{"key": {w.LockOf(info)}}.Encode())
		for _, s := range want {
			if !strings.Contains(body, s) {
				t.Errorf("%s lock page lacks %q", typ, s)
			}
		}
		for k := range fields {
			if strings.Contains(body, `<td class="mono">`+k+"</td>") {
				t.Errorf("%s lock page prints the mode record's field %s", typ, k)
			}
		}
		if regexp.MustCompile(`running policy|Raw fields|\([ad]\)`).MatchString(body) {
			t.Errorf("%s lock page prints a policy's code:\n%s", typ, body)
		}
	}
}

// ---- what a hostile request, or a hostile name read from Redis, cannot do ----

// serveOne serves one request straight to h (any request-URI, any method)
// and returns the response.
func serveOne(h http.Handler, method, target string, body string, header http.Header) *httptest.ResponseRecorder {
	var r *http.Request
	if body == "" {
		r = httptest.NewRequest(method, target, nil)
	} else {
		r = httptest.NewRequest(method, target, strings.NewReader(body))
		r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range header {
		r.Header[k] = v
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	return rec
}

// quietHandler is a handler of the world's prefix, quiet.
func quietHandler(w *webtest.World, opts dedupweb.Options) *dedupweb.Handler {
	opts.Prefix = w.Prefix
	if opts.Logger == nil {
		opts.Logger = redistest.QuietLogger()
	}
	return dedupweb.New(w.RDB, opts)
}

// Promised (docs/web.md, Search): "by type and key (fields path=value one a
// line ...)"; bad input is a usage error (lockview.UsageError: "dedupweb
// answers 400"); Options.Timeout bounds a request. The pages need no
// authorization by default (AuthorizePages false), so whoever can read
// them can send this.
//
// Tried here: one GET of /search?type=x&field=<800,000 dots>=1 (an 800 KB
// request line, under net/http's 1 MB header limit): the process that
// serves the handler (dedupctl serve, or the application that mounts it
// next to asynqmon) survives it. (Once, lockview.PayloadOf nested one JSON
// object per path segment before any check, and json.Marshal recursed past
// Go's 1 GB stack limit, a fatal error no recover catches.) Run in a child
// process so that this test can report a death.
func TestSearchFieldPathCannotCrashTheProcess(t *testing.T) {
	const dots = 800000
	if os.Getenv("DEDUPWEB_SEARCH_CHILD") == "1" {
		w := webtest.New(t)
		srv := w.Serve(dedupweb.Options{})
		code, body := get(t, http.DefaultClient, srv.URL+"/search?type=x&field="+strings.Repeat(".", dots)+"%3D1")
		fmt.Printf("child: answered %d: %s\n", code, errorText(body))
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestSearchFieldPathCannotCrashTheProcess$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), "DEDUPWEB_SEARCH_CHILD=1")
	start := time.Now()
	out, err := cmd.CombinedOutput()
	lines := strings.Split(string(out), "\n")
	var head []string
	for _, l := range lines {
		if strings.HasPrefix(l, "child:") || strings.HasPrefix(l, "runtime:") || strings.HasPrefix(l, "fatal error") || strings.Contains(l, "--- ") {
			head = append(head, l)
		}
	}
	if err != nil {
		t.Errorf("one GET of a search with a field path of %d dots killed the process after %v (%v):\n%s", dots, time.Since(start).Round(time.Millisecond), err, strings.Join(head, "\n"))
	} else {
		t.Logf("child survived in %v:\n%s", time.Since(start).Round(time.Millisecond), strings.Join(head, "\n"))
	}
}

// Promised (docs/web.md, Actions): "The lock is released only while that
// holder still holds it and has not taken it again (the compare-and-delete
// of dedupctl release)."
//
// Tried here: the confirmation page is loaded; the same holder then takes the
// key again (a later take time, as when a released, still-queued holder
// starts and re-locks). The form is then submitted with its token intact
// but (a) without the `created` field, (b) with `created` set to the new
// take time. The token binds only the key and holder, and `created` is
// optional, so neither should be able to release the re-taken lock.
func TestReleaseRefusesALockTakenAgain(t *testing.T) {
	w := webtest.New(t)
	ctx := context.Background()
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	for _, how := range []string{"as shown", "created dropped", "created forged"} {
		info := w.Enqueue(w.QA, "email:welcome", len(how))
		key := w.LockOf(info)
		_, confirm := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {key}}.Encode())
		form := hidden(confirm)
		created, err := strconv.ParseInt(form.Get("created"), 10, 64)
		if err != nil || created == 0 {
			t.Fatalf("confirmation form has no created: %v", form)
		}
		again := store.WrapValue(info.ID, time.Unix(created+5, 0)) // taken again by the same holder, later
		if err := w.RDB.SetArgs(ctx, key, again, redis.SetArgs{KeepTTL: true}).Err(); err != nil {
			t.Fatal(err)
		}
		switch how {
		case "created dropped":
			form = without(form, "created")
		case "created forged":
			form = with(form, "created", strconv.FormatInt(created+5, 10))
		}
		code, body := post(t, srv.URL+"/release", form, nil)
		if code == http.StatusOK || !w.Exists(key) {
			t.Errorf("%s: a lock its holder took again since the confirmation was released: %d %s", how, code, errorText(body))
		}
	}
}

// errorText extracts the message of a result or error page.
func errorText(body string) string {
	if m := regexp.MustCompile(`(?s)<(?:p class="err" id="error"|div class="ok" id="result")>(.*?)</(?:p|div)>`).FindStringSubmatch(body); m != nil {
		return html.UnescapeString(m[1])
	}
	if len(body) > 300 {
		return body[:300]
	}
	return body
}

// Promised (docs/web.md): "A GET never changes anything. The CSRF token is
// an HMAC, under a random key of the handler, of the action, the locks and
// holders shown, and the time ...; a POST whose Origin (or Referer) names
// another host is refused too."
//
// Tried here: a release token replayed as a doctor-fix token and vice versa, a
// token of another handler on the same Redis, the form sent by GET, HEAD,
// PUT, PATCH, DELETE, with X-HTTP-Method-Override, in the query string of
// a POST, as text/plain (a cross-site form without preflight), from an
// Origin "null" with a cross-site Referer, without Origin and with a
// cross-site Referer, from the same host on another port, with Origin
// "http://127.0.0.1:port@evil.example"; none may release. Multipart with
// the right token may.
func TestCSRFTokenCannotBeReplayedElsewhere(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "email:welcome", 1)
	orphan := w.Enqueue(w.QA, "email:welcome", 2)
	w.Orphan(orphan)
	key, okey := w.LockOf(info), w.LockOf(orphan)
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	twin := w.Serve(dedupweb.Options{AllowRelease: true}) // same Redis, same prefix, its own secret
	_, confirm := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {key}}.Encode())
	form := hidden(confirm)
	_, oconfirm := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {okey}}.Encode())
	oform := hidden(oconfirm)
	_, fixPage := get(t, http.DefaultClient, srv.URL+"/doctor/fix?grace=0s")
	fix := hidden(fixPage)
	if fix.Get("csrf") == "" || fix.Get("key") != okey {
		t.Fatalf("doctor fix form %v", fix)
	}
	refused := func(what string, code int, body string) {
		t.Helper()
		if code == http.StatusOK || !w.Exists(key) || !w.Exists(okey) {
			t.Fatalf("%s released: %d %s", what, code, errorText(body))
		}
	}
	// A release token of the orphan as a doctor-fix token for it, and back.
	code, body := post(t, srv.URL+"/doctor/fix", url.Values{"key": {okey}, "holder": {oform.Get("holder")}, "csrf": {oform.Get("csrf")}, "grace": {"0s"}}, nil)
	refused("release token on /doctor/fix", code, body)
	code, body = post(t, srv.URL+"/release", url.Values{"key": {okey}, "holder": {fix.Get("holder")}, "csrf": {fix.Get("csrf")}}, nil)
	refused("doctor-fix token on /release", code, body)
	code, body = post(t, twin.URL+"/release", form, nil)
	refused("token of another handler", code, body)
	// Splitting the pair across the NUL the subject joins with.
	code, body = post(t, srv.URL+"/release", url.Values{"key": {key + "\x00" + form.Get("holder")}, "holder": {""}, "csrf": {form.Get("csrf")}}, nil)
	refused("key and holder shifted across NUL", code, body)
	// Other methods and places for the form.
	for _, m := range []string{http.MethodGet, http.MethodHead, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions} {
		req, _ := http.NewRequest(m, srv.URL+"/release?"+form.Encode(), strings.NewReader(form.Encode()))
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		req.Header.Set("X-HTTP-Method-Override", "POST")
		code, body := send(t, http.DefaultClient, req)
		if m != http.MethodGet && m != http.MethodHead && code == http.StatusOK {
			t.Errorf("%s /release answered 200", m)
		}
		refused(m+" /release", http.StatusTeapot, body)
		_ = code
	}
	code, body = post(t, srv.URL+"/release?"+form.Encode(), nil, nil)
	refused("POST with the form in the query", code, body)
	req, _ := http.NewRequest(http.MethodPost, srv.URL+"/release", strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "text/plain")
	code, body = send(t, http.DefaultClient, req)
	refused("text/plain POST", code, body)
	for name, h := range map[string]http.Header{
		"Origin null, cross-site Referer": {"Origin": {"null"}, "Referer": {"http://evil.example/x"}},
		"no Origin, cross-site Referer":   {"Referer": {"https://evil.example/" + strings.TrimPrefix(srv.URL, "http://")}},
		"same host, other port":           {"Origin": {"http://127.0.0.1:1"}},
		"userinfo trick":                  {"Origin": {srv.URL + "@evil.example"}},
		"Referer naming host as user":     {"Referer": {"http://" + strings.TrimPrefix(srv.URL, "http://") + "@evil.example/"}},
	} {
		code, body := post(t, srv.URL+"/release", form, h)
		if code != http.StatusForbidden {
			t.Errorf("%s: %d, want 403", name, code)
		}
		refused(name, code, body)
	}
	// Multipart with the right token is the same form.
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	for k, vs := range form {
		_ = mw.WriteField(k, vs[0])
	}
	_ = mw.Close()
	req, _ = http.NewRequest(http.MethodPost, srv.URL+"/release", &mp)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	if code, body := send(t, http.DefaultClient, req); code != http.StatusOK || w.Exists(key) {
		t.Errorf("multipart release with the right token: %d %s", code, errorText(body))
	}
}

// Promised (dedupweb.go, Options.AllowRelease): "Default false: read-only,
// no action is offered and every POST is refused with 403."; docs/web.md:
// "A GET never changes anything."
//
// Tried here: on a read-only handler mounted at /dedup, the actions by every
// spelling of their path (double slashes, dot segments, encoded slashes and
// dots, trailing slash or dot, case) and method, with a token minted by a
// handler that allows releases.
func TestReadOnlyHasNoBackDoor(t *testing.T) {
	w := webtest.New(t)
	orphan := w.Enqueue(w.QA, "email:welcome", 1)
	w.Orphan(orphan)
	key := w.LockOf(orphan)
	rw := quietHandler(w, dedupweb.Options{AllowRelease: true, RootPath: "/dedup"})
	ro := quietHandler(w, dedupweb.Options{RootPath: "/dedup"})
	form := hidden(serveOne(rw, "GET", "/dedup/release?"+url.Values{"key": {key}}.Encode(), "", nil).Body.String())
	fix := hidden(serveOne(rw, "GET", "/dedup/doctor/fix?grace=0s", "", nil).Body.String())
	if form.Get("csrf") == "" || fix.Get("csrf") == "" {
		t.Fatal("no tokens from the releasing handler")
	}
	paths := []string{"/dedup/release", "/dedup//release", "/dedup/./release", "/dedup/%2e/release", "/dedup/%2Frelease",
		"/dedup/release/", "/dedup/release.", "/dedup/RELEASE", "/dedup/x/../release", "/dedup/doctor/fix", "/dedup/doctor//fix",
		"/dedup/doctor/fix/", "/dedup/doctor%2Ffix", "/dedup//doctor/fix", "/dedup"}
	for _, p := range paths {
		for _, m := range []string{"POST", "PUT", "PATCH", "DELETE", "GET"} {
			body := form.Encode()
			if strings.Contains(p, "fix") {
				body = fix.Encode()
			}
			rec := serveOne(ro, m, p+"?"+form.Encode(), body, nil)
			if rec.Code == http.StatusOK && strings.Contains(rec.Body.String(), "released") && !strings.Contains(rec.Body.String(), "releases nothing") {
				t.Errorf("read-only %s %s: %d %s", m, p, rec.Code, errorText(rec.Body.String()))
			}
			if m == "POST" && rec.Code != http.StatusForbidden && rec.Code/100 != 3 && rec.Code != http.StatusNotFound {
				t.Errorf("read-only POST %s: %d, want 403 (or a redirect/404 that does nothing)", p, rec.Code)
			}
			if !w.Exists(key) {
				t.Fatalf("read-only %s %s released the lock", m, p)
			}
		}
	}
}

// Promised (docs/web.md): "Authorize ... called before every action; an
// error refuses it (403)"; "AuthorizePages: pass every page through
// Authorize too".
//
// Tried here: with AuthorizePages and an Authorize that refuses everyone, try
// every page and action under /dedup and around it: double slashes,
// encoded slashes, dot segments, trailing dots, HEAD/OPTIONS/POST. No
// answer may be a 200 or show a lock's holder, type or queue (a redirect's
// body only echoes the URL asked for); redirects stay on the site (where
// under it is TestRedirectsStayUnderRootPath's business).
func TestAuthorizePagesGuardsEveryPath(t *testing.T) {
	w := webtest.New(t)
	info := w.Enqueue(w.QA, "email:welcome", 1)
	key := w.LockOf(info)
	var calls sync.Map
	h := quietHandler(w, dedupweb.Options{RootPath: "/dedup", AllowRelease: true, AuthorizePages: true,
		Authorize: func(r *http.Request) error { calls.Store(r.URL.Path, true); return errors.New("nobody") }})
	k := url.Values{"key": {key}}.Encode()
	paths := []string{"/dedup/", "/dedup/locks", "/dedup/lock?" + k, "/dedup/search?task=" + info.ID, "/dedup/search?lock=" + url.QueryEscape(key),
		"/dedup/doctor?grace=0s", "/dedup/release?" + k, "/dedup/doctor/fix?grace=0s",
		"/dedup//locks", "/dedup/%2Flocks", "/dedup/./locks", "/dedup/locks/", "/dedup/locks.", "/dedup/lock/?" + k, "/dedup//lock?" + k,
		"/dedup/%6cocks", "/dedup/lock%3F" + k, "/dedup/x/../lock?" + k, "/dedup/../dedup/lock?" + k, "/dedupx/lock?" + k,
		"/DEDUP/lock?" + k, "/dedup", "//dedup/lock?" + k, "/dedup/?" + k}
	for _, p := range paths {
		for _, m := range []string{"GET", "HEAD", "OPTIONS", "POST"} {
			rec := serveOne(h, m, p, "", nil)
			b := rec.Body.String()
			redirect := rec.Code/100 == 3 // its body only echoes the URL asked for
			if rec.Code == http.StatusOK || (!redirect && (strings.Contains(b, info.ID) || strings.Contains(b, "email:welcome") || strings.Contains(b, w.QA))) {
				t.Errorf("%s %s: %d, shows data: %s", m, p, rec.Code, errorText(b))
			}
			if loc := rec.Header().Get("Location"); loc != "" {
				u, err := url.Parse(loc)
				if err != nil || u.Host != "" || strings.HasPrefix(loc, "//") {
					t.Errorf("%s %s redirects off site to %q", m, p, loc)
				}
			}
		}
	}
}

// Promised (dedupweb.go, Options.RootPath): "the path the handler is
// mounted at ...; its links start with it"; search (docs/web.md) shows the
// lock found. A redirect is a link: it must stay on the site and under
// RootPath, with no header injection.
//
// Tried here: search by lock keys whose queue is `//evil.com`, `\\evil.com`,
// `/\evil.com` or holds CRLF + a header; and, on the handler served
// directly (as dedupctl serve does), paths under RootPath that the inner
// mux cleans: "/dedup//evil.com/", "/dedup/.//locks", "/dedup//release".
func TestRedirectsStayUnderRootPath(t *testing.T) {
	w := webtest.New(t)
	fp := "0123456789abcdef"
	for _, root := range []string{"", "/dedup"} {
		h := quietHandler(w, dedupweb.Options{RootPath: root})
		for _, q := range []string{"//evil.com", `\\evil.com`, `/\evil.com`, "x\r\nSet-Cookie: pwn=1", "x\nLocation: //evil.com", "@evil.com", "javascript:alert(1)"} {
			lock := store.NewKeys(w.Prefix).Lock(q, fp)
			rec := serveOne(h, "GET", root+"/search?"+url.Values{"lock": {lock}}.Encode(), "", nil)
			loc := rec.Header().Get("Location")
			if rec.Code != http.StatusSeeOther || !strings.HasPrefix(loc, root+"/lock?key=") || strings.ContainsAny(loc, "\r\n\\") || rec.Header().Get("Set-Cookie") != "" {
				t.Errorf("root %q, queue %q: %d to %q", root, q, rec.Code, loc)
			}
			if u, err := url.Parse(loc); err != nil || u.Host != "" || u.Scheme != "" || u.Query().Get("key") != lock {
				t.Errorf("root %q, queue %q: Location %q does not name the lock on this site", root, q, loc)
			}
		}
	}
	h := quietHandler(w, dedupweb.Options{RootPath: "/dedup", AllowRelease: true})
	for _, p := range []string{"/dedup//evil.com/", "/dedup/.//locks", "/dedup//release?key=x", "/dedup/..//evil.com", "/dedup/%2F%2Fevil.com"} {
		rec := serveOne(h, "GET", p, "", nil)
		loc := rec.Header().Get("Location")
		if loc == "" {
			continue
		}
		u, err := url.Parse(loc)
		if err != nil || u.Host != "" || strings.HasPrefix(loc, "//") || !strings.HasPrefix(loc, "/dedup/") {
			t.Errorf("GET %s: %d to %q, outside RootPath /dedup", p, rec.Code, loc)
		}
	}
}

// noHostileMarkup fails for markup a hostile name could have injected.
func noHostileMarkup(t *testing.T, what, body string) {
	t.Helper()
	low := strings.ToLower(body)
	for _, bad := range []string{"<script", "<img", "<svg onload", "<svg/onload", "<a href=\"javascript", "<iframe"} {
		if strings.Contains(low, bad) {
			i := strings.Index(low, bad)
			t.Errorf("%s: raw %q in the page: …%s…", what, bad, body[max(0, i-80):min(len(body), i+80)])
		}
	}
	for _, m := range regexp.MustCompile(`(?i)\s(href|src|action|formaction)="([^"]*)"`).FindAllStringSubmatch(body, -1) {
		v := strings.ToLower(strings.TrimSpace(html.UnescapeString(m[2])))
		if strings.HasPrefix(v, "javascript:") || strings.HasPrefix(v, "data:") || strings.HasPrefix(v, "vbscript:") || strings.HasPrefix(v, "//") || strings.HasPrefix(v, `/\`) {
			t.Errorf("%s: %s=%q", what, m[1], m[2])
		}
	}
}

// Promised (docs/web.md): "Every name read from Redis (types, queues, keys,
// IDs) goes through html/template: a type named <script>alert(1)</script>
// shows as that text." The asynqmon links are
// <root>/queues/<queue>/tasks/<id>.
//
// Tried here: a hostile type, queue, caller-chosen task ID (starting with
// "javascript:"), asynq last_error, follow-up ID and key-form field names
// (written into the key's mode record), counters of hostile types; every page,
// confirmation, doctor, search and error page, with asynqmon links on.
func TestHostileNamesAreInert(t *testing.T) {
	w := webtest.New(t)
	ctx := context.Background()
	tag := w.Prefix[len("web-"):]
	evilType := `<script>alert("type")</script>` + tag
	failType := evilType + `<img src=x onerror=alert("fail")>`
	evilQueue := "q" + tag + `"><img src=x onerror=alert('queue')>`
	evilID := `javascript:alert('id')//"><svg onload=alert('id2')>` + tag
	evilErr := `<script>alert("err")</script><a href="javascript:alert('err')">x</a>`
	payload := []byte(`{"user_id":1}`)
	_, err := w.Client.Enqueue(asynq.NewTask(evilType, payload), asynq.Queue(evilQueue), dedup.Fields("user_id"), asynq.TaskID(evilID))
	if err != nil {
		t.Fatal(err)
	}
	heldKey := lockKeyOf(t, w, evilType, evilQueue, payload)
	orphan, err := w.Client.Enqueue(asynq.NewTask(evilType, []byte(`{"user_id":2}`)), asynq.Queue(evilQueue), dedup.Fields("user_id"), asynq.TaskID(evilID+"-o"))
	if err != nil {
		t.Fatal(err)
	}
	orphanKey := lockKeyOf(t, w, evilType, evilQueue, []byte(`{"user_id":2}`))
	w.Orphan(orphan)
	writeHostileModeRecord(t, w, heldKey, evilID)
	// A retry-wait lock whose asynq last_error is hostile.
	mux := asynq.NewServeMux()
	mux.Use(w.D.Middleware())
	mux.HandleFunc(failType, func(context.Context, *asynq.Task) error { return errors.New(evilErr) })
	srv := asynq.NewServerFromRedisClient(w.RDB, asynq.Config{Concurrency: 2, Queues: map[string]int{evilQueue: 1},
		TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.FatalLevel, ShutdownTimeout: 5 * time.Second, IsFailure: dedup.IsFailure,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour }})
	failing, err := w.Client.Enqueue(asynq.NewTask(failType, []byte(`{"user_id":3}`)), asynq.Queue(evilQueue), dedup.Fields("user_id"))
	if err != nil {
		t.Fatal(err)
	}
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	redistest.Eventually(t, "the failing task to wait for its retry", func() bool {
		ti, err := w.Insp.GetTaskInfo(evilQueue, failing.ID)
		return err == nil && ti.State == asynq.TaskStateRetry && ti.LastErr != ""
	})
	if err := w.D.FlushStats(ctx); err != nil {
		t.Fatal(err)
	}
	h := w.Serve(dedupweb.Options{AllowRelease: true, AsynqmonRoot: "/monitoring"})
	failKey := w.LockOf(failing)
	pages := []string{"/", "/locks", "/locks?" + url.Values{"queue": {evilQueue}, "type": {evilType}}.Encode(),
		"/doctor?grace=0s", "/doctor/fix?grace=0s",
		"/search?" + url.Values{"task": {evilID}, "queue": {evilQueue}}.Encode(),
		"/search?" + url.Values{"type": {evilType}, "field": {"user_id=1"}, "queue": {evilQueue}}.Encode(),
		"/search?" + url.Values{"lock": {`"><script>alert('search')</script>`}}.Encode(),
		"/search?" + url.Values{"task": {`"><script>alert('task')</script>`}}.Encode(),
		"/lock?" + url.Values{"key": {`<script>alert('key')</script>`}}.Encode(),
		"/locks?" + url.Values{"cursor": {`<script>alert('cursor')</script>`}}.Encode(),
		"/doctor?" + url.Values{"grace": {`<script>alert('grace')</script>`}}.Encode(),
	}
	for _, k := range []string{heldKey, failKey, orphanKey} {
		pages = append(pages, "/lock?"+url.Values{"key": {k}}.Encode(), "/release?"+url.Values{"key": {k}}.Encode())
	}
	sawErr, sawType := false, false
	for _, p := range pages {
		code, body := get(t, http.DefaultClient, h.URL+p)
		noHostileMarkup(t, p, body)
		sawErr = sawErr || strings.Contains(body, `&lt;script&gt;alert(&#34;err&#34;)`)
		sawType = sawType || (code == http.StatusOK && strings.Contains(body, `&lt;script&gt;alert(&#34;type&#34;)`))
	}
	if !sawErr || !sawType {
		t.Errorf("the hostile names were not shown at all (last_error shown %v, type shown %v): the test proves nothing", sawErr, sawType)
	}
}

// writeHostileModeRecord gives the lock at key, held by holder, a mode
// record with a hostile follow-up ID and key form.
func writeHostileModeRecord(t *testing.T, w *webtest.World, key, holder string) {
	t.Helper()
	err := w.RDB.HSet(context.Background(), store.ModeOf(key), store.FieldHolder, holder, store.FieldFollow, `javascript:alert('f')"><img src=x>`,
		store.FieldKeyForm, "f:"+`a"><script>alert('kf')</script>`+"\x00"+`<img src=x onerror=alert(1)>`).Err()
	if err != nil {
		t.Fatal(err)
	}
}

// lockKeyOf is the lock key a task of typ keyed on user_id holds.
func lockKeyOf(t *testing.T, w *webtest.World, typ, queue string, payload []byte) string {
	t.Helper()
	kl, found, err := w.D.Lookup(context.Background(), asynq.NewTask(typ, payload), asynq.Queue(queue), dedup.Fields("user_id"))
	if err != nil || !found {
		t.Fatalf("lookup %s in %s: %v, %v", typ, queue, found, err)
	}
	return kl.Key
}

// Promised (docs/web.md): "The payload only through PayloadFormatter";
// dedupweb.go: "Default nil: payloads are never shown (they may hold
// personal data)."
//
// Tried here: locks in every state (waiting, running, retry-wait, cooling,
// orphaned) whose payloads hold an e-mail address; a Merge/RunningDefer
// key with a follow-up owed; every page, confirmation, doctor, search,
// and error pages reached with those keys and IDs, without a formatter.
func TestNoPayloadWithoutFormatter(t *testing.T) {
	w := webtest.New(t)
	s := w.Populate()
	infos := []*asynq.TaskInfo{s.Running, s.RetryWait, s.Cooling}
	for u := 10; u < 12; u++ {
		infos = append(infos, w.Enqueue(w.QA, "email:welcome", u))
	}
	o := w.Enqueue(w.QA, "email:welcome", 12)
	w.Orphan(o)
	infos = append(infos, o)
	srv := w.Serve(dedupweb.Options{AllowRelease: true, AsynqmonRoot: "/monitoring"})
	pages := []string{"/", "/locks", "/doctor?grace=0s", "/doctor/fix?grace=0s", "/search?" + url.Values{"type": {"email:welcome"}, "field": {"user_id=10"}, "queue": {w.QA}}.Encode()}
	for _, in := range infos {
		k := url.Values{"key": {w.LockOf(in)}}.Encode()
		pages = append(pages, "/lock?"+k, "/release?"+k, "/search?"+url.Values{"task": {in.ID}}.Encode())
	}
	for _, p := range pages {
		code, body := get(t, http.DefaultClient, srv.URL+p)
		if code >= 500 {
			t.Errorf("%s: %d", p, code)
		}
		if i := strings.Index(body, "@example.com"); i >= 0 {
			t.Errorf("%s shows a payload: …%s…", p, body[max(0, i-120):min(len(body), i+40)])
		}
	}
}

// Promised (dedupweb.go, Options.Timeout): "Timeout bounds the Redis work of
// one request"; search errors are usage errors (400/404), not 500s.
//
// Tried here: 1 MB query values in every parameter, 10,000 key fields, a 1 MB
// JSON nesting, a 5 MB POST and a doctor fix of 10,000 pairs; each must be
// answered with a 4xx quickly. (A deeply dotted field path is
// TestSearchFieldPathCannotCrashTheProcess.)
func TestHugeInputsAreBounded(t *testing.T) {
	w := webtest.New(t)
	w.Enqueue(w.QA, "email:welcome", 1)
	h := quietHandler(w, dedupweb.Options{AllowRelease: true, Timeout: 2 * time.Second})
	mb := strings.Repeat("a", 1<<20)
	var fields strings.Builder
	for i := range 10000 {
		fmt.Fprintf(&fields, "f%d=%d\n", i, i)
	}
	var pairs url.Values = url.Values{"csrf": {"1.00"}, "grace": {"0s"}}
	for i := range 10000 {
		pairs.Add("key", store.NewKeys(w.Prefix).Lock("q", fmt.Sprintf("%016x", i)))
		pairs.Add("holder", strconv.Itoa(i))
	}
	cases := []struct{ method, target, body string }{
		{"GET", "/search?" + url.Values{"type": {"x"}, "field": {fields.String()}}.Encode(), ""},
		{"GET", "/search?" + url.Values{"type": {"x"}, "field": {"a=" + mb}}.Encode(), ""},
		{"GET", "/search?" + url.Values{"type": {"x"}, "payload": {strings.Repeat("[", 1<<20)}, "fields": {"a"}}.Encode(), ""},
		{"GET", "/search?" + url.Values{"type": {"x"}, "key": {mb}, "queue": {w.QA}}.Encode(), ""},
		{"GET", "/search?" + url.Values{"lock": {mb}}.Encode(), ""},
		{"GET", "/search?" + url.Values{"task": {mb}, "queue": {w.QA}}.Encode(), ""},
		{"GET", "/lock?" + url.Values{"key": {mb}}.Encode(), ""},
		{"GET", "/locks?" + url.Values{"cursor": {strings.Repeat("9", 1<<20)}}.Encode(), ""},
		{"GET", "/doctor?" + url.Values{"grace": {mb}}.Encode(), ""},
		{"POST", "/release", "key=" + strings.Repeat("b", 5<<20)},
		{"POST", "/doctor/fix", pairs.Encode()},
	}
	for _, c := range cases {
		start := time.Now()
		rec := serveOne(h, c.method, c.target, c.body, nil)
		took := time.Since(start)
		name := c.target
		if len(name) > 60 {
			name = name[:60] + "…"
		}
		if rec.Code/100 != 4 || took > 5*time.Second {
			t.Errorf("%s %s: %d in %v (%d bytes), want a 4xx quickly: %s", c.method, name, rec.Code, took, rec.Body.Len(), errorText(rec.Body.String()))
		}
		if rec.Body.Len() > 8<<20 {
			t.Errorf("%s %s: a %d-byte answer", c.method, name, rec.Body.Len())
		}
	}
}

// Promised (docs/web.md): the handler shows the locks of Options.Prefix;
// Locks is "filtered by queue, type and state, a page at a time by SCAN
// cursor"; the lock page takes a lock key of the prefix.
//
// Tried here: another deployment's locks in the same Redis under a prefix that
// extends this one ("<prefix>x", "<prefix>:{x"), forged cursors (random,
// huge, a cluster-style "addr/n"), and glob characters in the queue
// filter. No page may show a lock of the other prefixes, nor a queue the
// filter does not name.
func TestCursorAndFiltersStayInPrefix(t *testing.T) {
	w := webtest.New(t)
	ctx := context.Background()
	mine := w.LockOf(w.Enqueue(w.QA, "email:welcome", 1))
	var foreign []string
	for i, p := range []string{w.Prefix + "x", w.Prefix + ":{x"} {
		d, err := dedup.New(ctx, w.RDB, dedup.Config{Prefix: p, Logger: redistest.QuietLogger()})
		if err != nil {
			t.Logf("prefix %q refused: %v", p, err)
			continue
		}
		t.Cleanup(func() { _ = d.Close() })
		info, err := d.NewClient().Enqueue(asynq.NewTask("email:welcome", fmt.Appendf(nil, `{"user_id":%d}`, 100+i)), asynq.Queue(w.QA), dedup.Fields("user_id"))
		if err != nil {
			t.Fatal(err)
		}
		foreign = append(foreign, info.ID)
	}
	h := quietHandler(w, dedupweb.Options{PageSize: 1})
	targets := []string{"/", "/locks", "/locks?queue=*", "/locks?queue=" + url.QueryEscape(w.QA[:3]+"*"), "/locks?queue=" + url.QueryEscape("x}:u:*"),
		"/doctor?grace=0s", "/locks?cursor=18446744073709551615", "/locks?cursor=127.0.0.1:6379/0"}
	for c := range 64 {
		targets = append(targets, "/locks?cursor="+strconv.Itoa(c*7919))
	}
	for _, target := range targets {
		rec := serveOne(h, "GET", target, "", nil)
		b := rec.Body.String()
		for _, id := range foreign {
			if strings.Contains(b, id) {
				t.Errorf("%s shows %s, a lock of another prefix", target, id)
			}
		}
		if strings.Contains(target, "queue=") && strings.Contains(b, html.EscapeString(mine)) {
			t.Errorf("%s: a glob in the queue filter matched queue %s", target, w.QA)
		}
	}
}

// Promised (docs/web.md): "Per type, the counters of the last hour ...
// each with a small bar chart"; flush.go/keys.go: the minute hash is
// "<prefix>:stats:min:<unix minute>:<type>".
//
// Tried here: task types made to collide in that layout or in Redis patterns:
// "a", "a:1", "1:a", "min:1", "*", "?", "[x]", "%d", "a\nb", a 4 KB name,
// and a prefix-like "x:stats:min:1". Each type's counts must show under
// its own name only, exactly as counted.
func TestMinuteCountersOfOddTypesShowUnderTheirOwnNames(t *testing.T) {
	w := webtest.New(t)
	types := map[string]int{"a": 1, "a:1": 2, "1:a": 3, "min:1": 4, "*": 5, "?": 6, "[x]": 7, "%d": 8, "a\nb": 9, strings.Repeat("L", 4096): 10, "x:stats:min:1": 11}
	for typ, n := range types {
		for u := range n {
			w.Enqueue(w.QA, typ, u)
		}
	}
	if err := w.D.FlushStats(context.Background()); err != nil {
		t.Fatal(err)
	}
	srv := w.Serve(dedupweb.Options{})
	_, body := get(t, http.DefaultClient, srv.URL+"/")
	for typ, n := range types {
		re := regexp.MustCompile(`(?s)<h3 class="mono">` + regexp.QuoteMeta(html.EscapeString(typ)) + `</h3>\s*<div class="charts">\s*<div class="chart" data-series="locked"><div><strong>locked</strong> <span class="n">(\d+)</span>`)
		m := re.FindAllStringSubmatch(body, -1)
		if len(m) != 1 || m[0][1] != strconv.Itoa(n) {
			t.Errorf("type %.20q: locked charts %v, want one with %d", typ, m, n)
		}
	}
}

// The doctor page lists a key with no lock that owes a follow-up still
// parked (the owed signal missed it), as "owed", and its fix queues the
// follow-up now.
func TestDoctorShowsAnOwedFollowUpAndFixQueuesIt(t *testing.T) {
	w := webtest.New(t)
	ctx := context.Background()
	lock := store.NewKeys(w.Prefix).Lock(w.QA, "00000000000000f1")
	holder, follow := store.NewPlainID(), store.NewFollowID()
	raw := asynq.NewClientFromRedisClient(w.RDB)
	if _, err := raw.EnqueueContext(ctx, asynq.NewTask("report:build", nil), asynq.Queue(w.QA), asynq.TaskID(follow), asynq.ProcessIn(time.Hour)); err != nil {
		t.Fatal(err)
	}
	w.RDB.HSet(ctx, store.ModeOf(lock), store.FieldHolder, holder, store.FieldType, "report:build", store.FieldRunning, "d", store.FieldFollow, follow)
	srv := w.Serve(dedupweb.Options{AllowRelease: true})
	_, body := get(t, http.DefaultClient, srv.URL+"/doctor")
	if !strings.Contains(body, "<td>owed</td>") || !strings.Contains(body, html.EscapeString(lock)) || !strings.Contains(body, follow) {
		t.Fatalf("doctor should list %s as owed:\n%s", lock, errorText(body))
	}
	_, confirm := get(t, http.DefaultClient, srv.URL+"/doctor/fix")
	code, body := post(t, srv.URL+"/doctor/fix", hidden(confirm), nil)
	if code != http.StatusOK || !strings.Contains(body, "queued now the follow-up "+follow) || !strings.Contains(body, "1 released") {
		t.Fatalf("doctor fix: %d\n%s", code, errorText(body))
	}
	if ti, err := w.Insp.GetTaskInfo(w.QA, follow); err != nil || ti.State != asynq.TaskStatePending {
		t.Fatalf("follow-up after the fix: %+v, %v; want pending", ti, err)
	}
}
