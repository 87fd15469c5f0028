package dedupweb

import (
	"context"
	"log/slog"
	"net/http"
	"sort"
	"strconv"
	"strings"

	"github.com/asynq-dedup/dedup/internal/lockview"
)

// confirmView is the confirmation page of a release.
type confirmView struct {
	base
	L     *lockview.Info
	Token string
}

// resultView says what an action did.
type resultView struct {
	base
	OK    bool
	Lines []string
	Back  string
}

// releaseSubject is what a release token is bound to: the lock, its holder
// and when that holder took it, as the confirmation page showed them.
func releaseSubject(key, holder, created string) string {
	return key + "\x00" + holder + "\x00" + created
}

// confirmRelease shows the lock to release and the form that releases it.
func (h *Handler) confirmRelease(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	t, err := lockview.ByKey(h.opts.Prefix, r.URL.Query().Get("key"))
	if err != nil {
		return &httpError{http.StatusBadRequest, err.Error()}
	}
	l, err := lockview.ReadOne(ctx, h.src, h.opts.Prefix, t)
	if err != nil {
		return err
	}
	h.logAction(r, "confirm", slog.String("action", "release"), slog.String("key", l.Key), slog.String("holder", l.Holder))
	v := confirmView{base: h.base("Release " + l.Key + "?"), L: l, Token: h.token("release", releaseSubject(l.Key, l.Holder, strconv.FormatInt(l.Created, 10)))}
	return h.render(w, http.StatusOK, "confirm", v)
}

// postRelease releases the lock the confirmation page showed, only while
// the holder is still the one it showed and has not taken it again.
func (h *Handler) postRelease(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	key, holder := r.PostFormValue("key"), r.PostFormValue("holder")
	what := []slog.Attr{slog.String("action", "release"), slog.String("key", key), slog.String("holder", holder)}
	err := h.release(ctx, w, r, key, holder)
	if err != nil {
		h.logAction(r, "refused", append(what, slog.String("error", err.Error()))...)
		return err
	}
	h.logAction(r, "released", what...)
	return nil
}

func (h *Handler) release(ctx context.Context, w http.ResponseWriter, r *http.Request, key, holder string) error {
	created := r.PostFormValue("created")
	if err := h.checkToken(r, "release", releaseSubject(key, holder, created)); err != nil {
		return err
	}
	t, err := lockview.ByKey(h.opts.Prefix, key)
	if err != nil {
		return &httpError{http.StatusBadRequest, err.Error()}
	}
	l, err := lockview.ReadOne(ctx, h.src, h.opts.Prefix, t)
	if err != nil {
		return err
	}
	if l.Holder != holder {
		return &httpError{http.StatusConflict, "not released: " + key + " changed holder from " + holder + " to " + l.Holder + " since you confirmed; look at it again"}
	}
	if created != strconv.FormatInt(l.Created, 10) {
		return &httpError{http.StatusConflict, "not released: " + holder + " took " + key + " again since you confirmed; look at it again"}
	}
	res, err := lockview.Release(ctx, h.src, h.opts.Prefix, l)
	if err != nil {
		return &httpError{http.StatusConflict, err.Error()}
	}
	lines := []string{"released " + l.Key + " (type " + l.Type + ", holder " + l.Holder + ", " + l.State + ", " + l.TTL + " left)"}
	lines = append(lines, res.Notes...)
	v := resultView{base: h.base("Released"), OK: true, Lines: lines, Back: h.opts.RootPath + "/locks"}
	return h.render(w, http.StatusOK, "result", v)
}

// fixView is the confirmation page of releasing what the doctor found.
type fixView struct {
	base
	R     *lockview.Report
	Grace string
	Token string
}

// lockPair is a lock and its holder, as one string.
func lockPair(key, holder string) string { return key + "\x00" + holder }

// fixSubject binds a doctor token to the locks (key and holder) shown;
// the fix re-reads each holder in the releasing script (store.ReleaseStuck).
func fixSubject(keys, holders []string) string {
	pairs := make([]string, len(keys))
	for i := range keys {
		pairs[i] = lockPair(keys[i], holders[i])
	}
	sort.Strings(pairs)
	return strings.Join(pairs, "\n")
}

func (h *Handler) confirmFix(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	rep, g, err := h.diagnose(ctx, r)
	if err != nil {
		return err
	}
	var keys, holders []string
	for _, f := range rep.Findings {
		keys, holders = append(keys, f.Key), append(holders, f.Holder)
	}
	h.logAction(r, "confirm", slog.String("action", "doctor-fix"), slog.Int("locks", len(keys)))
	v := fixView{base: h.base("Release what the doctor found?"), R: rep, Grace: g.String(), Token: h.token("doctor-fix", fixSubject(keys, holders))}
	return h.render(w, http.StatusOK, "fix", v)
}

// postFix checks again and releases, of the locks the confirmation page
// listed, those whose holder still cannot run (store.ReleaseStuck).
func (h *Handler) postFix(ctx context.Context, w http.ResponseWriter, r *http.Request) error {
	if err := r.ParseForm(); err != nil {
		return &httpError{http.StatusBadRequest, err.Error()}
	}
	keys, holders := r.PostForm["key"], r.PostForm["holder"]
	if len(keys) != len(holders) {
		return &httpError{http.StatusBadRequest, "bad form: keys and holders do not pair"}
	}
	if err := h.checkToken(r, "doctor-fix", fixSubject(keys, holders)); err != nil {
		h.logAction(r, "refused", slog.String("action", "doctor-fix"), slog.String("error", err.Error()))
		return err
	}
	rep, _, err := h.diagnose(ctx, r)
	if err != nil {
		return err
	}
	shown := map[string]bool{}
	for i := range keys {
		shown[lockPair(keys[i], holders[i])] = true
	}
	rep.Fix(ctx, h.src, func(f *lockview.Finding) bool { return shown[lockPair(f.Key, f.Holder)] })
	return h.fixResult(w, r, rep)
}

// fixResult logs and shows what a doctor fix released.
func (h *Handler) fixResult(w http.ResponseWriter, r *http.Request, rep *lockview.Report) error {
	var lines []string
	for _, f := range rep.Findings {
		switch {
		case f.Released && f.FollowUp != "" && f.Problem == lockview.ProblemOwed:
			lines = append(lines, "queued now the follow-up "+f.FollowUp+" that "+f.Key+" owed (holder "+f.Holder+")")
		case f.Released && f.FollowUp != "":
			lines = append(lines, "released "+f.Key+" (holder "+f.Holder+") to its follow-up "+f.FollowUp+", queued now")
		case f.Released:
			lines = append(lines, "released "+f.Key+" (holder "+f.Holder+")")
		case f.Error != "":
			lines = append(lines, "not released "+f.Key+": "+f.Error)
		}
		if f.Released {
			h.logAction(r, "released", slog.String("action", "doctor-fix"), slog.String("key", f.Key), slog.String("holder", f.Holder), slog.String("problem", f.Problem))
		} else if f.Error != "" {
			h.logAction(r, "refused", slog.String("action", "doctor-fix"), slog.String("key", f.Key), slog.String("holder", f.Holder), slog.String("error", f.Error))
		}
	}
	lines = append(lines, strconv.Itoa(rep.Released)+" released")
	v := resultView{base: h.base("Doctor: released"), OK: true, Lines: lines, Back: h.opts.RootPath + "/doctor"}
	return h.render(w, http.StatusOK, "result", v)
}
