package dedupweb_test

import (
	"bytes"
	"context"
	"errors"
	"html"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/asynq-dedup/dedup"
	"github.com/asynq-dedup/dedup/dedupweb"
	"github.com/asynq-dedup/dedup/dedupweb/internal/webtest"
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
	form := url.Values{"key": {key}, "owner": {info.ID}}
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
// releases, owner-checked, and is logged.
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
	if form.Get("csrf") == "" || form.Get("owner") != info.ID || form.Get("key") != key {
		t.Fatalf("confirmation form %v:\n%s", form, confirm)
	}
	_, otherConfirm := get(t, http.DefaultClient, srv.URL+"/release?"+url.Values{"key": {w.LockOf(other)}}.Encode())
	bad := map[string]url.Values{
		"no token":      without(form, "csrf"),
		"forged token":  with(form, "csrf", "1700000000.00"),
		"other's token": with(form, "csrf", hidden(otherConfirm).Get("csrf")),
		"other owner":   with(form, "owner", other.ID),
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

// The token binds the owner shown: a lock taken by another task since the
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
	if code, body := post(t, srv.URL+"/release", form, nil); code != http.StatusConflict || !strings.Contains(body, "changed owner") {
		t.Errorf("release after the owner changed: %d\n%s", code, body)
	}
	if !w.Exists(key) {
		t.Fatal("the lock of another owner was released")
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
// though its holder cannot run: a cooling key, a failure hold (holder
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
	if !strings.Contains(body, "1 whose owner cannot run") || !strings.Contains(body, html.EscapeString(w.LockOf(orphan))) {
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

// A lock's page says its running policy in words, never the mode record's
// code for it.
func TestLockPageSaysTheRunningPolicyInWords(t *testing.T) {
	w := webtest.NewWithRules(t, map[string]dedup.Rule{
		"report:build": {Fields: []string{"user_id"}, OnRunning: dedup.RunningDefer, OnConflict: dedup.Replace},
		"report:live":  {Fields: []string{"user_id"}, OnRunning: dedup.RunningAllow},
	})
	srv := w.Serve(dedupweb.Options{})
	for typ, want := range map[string]string{
		"report:build": "<dt>running policy</dt><dd>defer: a duplicate enqueued while the holder runs becomes its one follow-up, queued when the run ends</dd>",
		"report:live":  "<dt>running policy</dt><dd>allow: the key frees when its task starts, so a duplicate enqueued while it runs is a new task</dd>",
	} {
		info := w.Enqueue(w.QA, typ, 1)
		_, body := get(t, http.DefaultClient, srv.URL+"/lock?"+url.Values{"key": {w.LockOf(info)}}.Encode())
		if !strings.Contains(body, want) {
			t.Errorf("%s lock page lacks %q", typ, want)
		}
		if regexp.MustCompile(`running policy</dt><dd>[^<]*\([ad]\)`).MatchString(body) {
			t.Errorf("%s lock page shows the policy's code", typ)
		}
	}
}
